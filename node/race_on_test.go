//go:build race

package node

// raceEnabled: built with -race (TestMain keeps -parallel's default then).
const raceEnabled = true
