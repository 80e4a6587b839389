package transfer_test

import (
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/actors/transfer"
	"github.com/kvactors/kvactors/internal/testkit"
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

// ResumedIn resumes loads only for a message taken in the current
// generation: one taken before a silence ended is no sign the engine came
// back.
func TestResumedInIgnoresAMessageTakenBeforeTheSilenceEnded(t *testing.T) {
	var h transfer.Hearing
	before := h.Gen()
	h.Silenced()
	require.Equal(t, before+1, h.Gen())
	require.True(t, h.LoadsRefused())
	h.ResumedIn(before)
	require.True(t, h.LoadsRefused(), "resumed by a message taken before the silence ended")
	h.ResumedIn(h.Gen())
	require.False(t, h.LoadsRefused())
	h.Silenced()
	h.Silenced()
	require.Equal(t, before+3, h.Gen())
	require.True(t, h.LoadsRefused())
}

// A Hearing measures silence on the monotonic clock (PROTOCOL.md "Engine
// silence"): a wall clock stepped forward (NTP, a resumed VM) must not make
// every engine silent at once, which resets all their work, nor one stepped
// back hide a real silence, which leaves the node-side fence open for the
// step's length.
func TestHearingIgnoresWallClockSteps(t *testing.T) {
	for _, step := range []time.Duration{time.Hour, -time.Hour} {
		var h transfer.Hearing
		heard := time.Now()
		h.Heard(heard)
		later := testkit.WallStepped(heard.Add(time.Second), step)
		require.Equal(t, time.Second, h.Silent(later), "wall clock stepped by %v", step)
		h.Heard(later) // the engine heard after the step: the latest
		require.Equal(t, time.Second, h.Silent(later.Add(time.Second)), "wall clock stepped by %v", step)
	}
}
