package transfer_test

import (
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/actors/transfer"
)

// A Hearing keeps the latest time it was told, whatever order concurrent
// Heards come in (two ingest shards never share an engine, but a register
// and a message may race), and is silent for no time before any.
func TestHearingKeepsTheLatest(t *testing.T) {
	var h transfer.Hearing
	start := time.Unix(1_800_000_000, 0)
	require.Zero(t, h.Silent(start.Add(time.Hour)), "never heard: not silent (nothing to fence)")
	var wg sync.WaitGroup
	for i := range 64 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			h.Heard(start.Add(time.Duration(i) * time.Second))
		}()
	}
	wg.Wait()
	require.Equal(t, time.Second, h.Silent(start.Add(64*time.Second)))
	h.Heard(start) // older: ignored
	require.Equal(t, time.Second, h.Silent(start.Add(64*time.Second)))
}
