//go:build race

package replay_test

// raceEnabled: the tests run under the race detector, whose build turns Pebble's invariants on; their
// checks allocate at random, so allocation counts measure Pebble rather than the code under test.
const raceEnabled = true
