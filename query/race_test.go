//go:build race

package query

// raceEnabled: the tests run under the race detector, several times slower.
const raceEnabled = true
