package actors

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
)

// An engine's Releases keeps the numbering of its KeptEpochs most recently
// released epochs, not of every epoch it ever used: the node keeps one per
// engine id for the whole boot, and an engine cycling register, a new
// epoch, a release and unregister would otherwise grow it without bound.
// An epoch released recently goes on with its rseq; the least recently
// released one is forgotten and starts again at 1.
func TestReleasesKeepsOnlyTheMostRecentlyReleasedEpochs(t *testing.T) {
	_, nc := testkit.NATS(t)
	released := testkit.Subscribe(t, nc, "kvactors.e1.released")
	o := NewOutbox(nc, "kvactors", slog.New(slog.NewTextHandler(io.Discard, nil)))
	r := NewReleases(o, "e1")
	ctx := context.Background()
	publish := func(epoch string) uint64 {
		t.Helper()
		require.True(t, r.Publish(ctx, epoch, "r", messages.ReasonFinished, nil))
		var rel messages.Released
		require.NoError(t, json.Unmarshal(testkit.Recv(t, released, 5*time.Second, "a release").Data, &rel))
		require.Equal(t, epoch, rel.Epoch)
		return rel.RSeq
	}
	require.Equal(t, uint64(1), publish("live"))
	for i := range 3 * KeptEpochs {
		require.Equal(t, uint64(1), publish(fmt.Sprintf("old%d", i)))
		if i%4 == 0 {
			publish("live") // released all along: never the least recent
		}
	}
	r.mu.Lock()
	kept := len(r.counts)
	_, first := r.counts["old0"]
	r.mu.Unlock()
	require.Equal(t, KeptEpochs, kept)
	require.False(t, first, "the least recently released epoch is forgotten")
	require.Equal(t, uint64(2+3*KeptEpochs/4), publish("live"), "a recent epoch's rseq goes on")
	require.Equal(t, uint64(2), publish(fmt.Sprintf("old%d", 3*KeptEpochs-1)))
	require.Equal(t, uint64(1), publish("old0"), "a forgotten epoch starts again")
}
