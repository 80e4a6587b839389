//go:build chaos

package main

import (
	"fmt"
	"os"
	"strconv"
	"testing"
)

// The kill -9 takeover, again and again on fresh clusters
// (KVACTORS_CHAOS_ROUNDS, default 10): every round must end with the
// standby serving both engines and every request released exactly once.
//
//	go test -tags chaos ./cmd/kvactors -run ClusterKillRounds -v
func TestClusterKillRounds(t *testing.T) {
	rounds := 10
	if v, err := strconv.Atoi(os.Getenv("KVACTORS_CHAOS_ROUNDS")); err == nil && v > 0 {
		rounds = v
	}
	for i := range rounds {
		if !t.Run(fmt.Sprintf("round%d", i), killAndTakeOver) {
			return
		}
	}
}
