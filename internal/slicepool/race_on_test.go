//go:build race

package slicepool

// raceEnabled: under -race sync.Pool drops a quarter of what it is given.
const raceEnabled = true
