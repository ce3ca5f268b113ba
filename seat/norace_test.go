//go:build !race

package seat_test

// raceEnabled: the tests run under the race detector, which slows decoding a request several times.
const raceEnabled = false
