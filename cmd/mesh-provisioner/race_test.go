//go:build race

package main

// raceEnabled: the tests run under the race detector, whose build turns Pebble's invariants on: their
// checks allocate at random and slow every read several times.
const raceEnabled = true
