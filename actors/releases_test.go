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

// An engine's Releases keeps the numbering of every epoch an actor still
// uses, however many others come and go, and of the KeptEpochs most
// recently retained by stopped actors, not of every epoch the engine ever
// used: the node keeps one per engine id for the whole boot, and an engine
// cycling register, a new epoch, a release and unregister would otherwise
// grow it without bound. A retained epoch released again goes on with its
// rseq and is kept while used; the one retained longest is forgotten and
// starts again at 1.
func TestReleasesKeepsUsedEpochsAndTheMostRecentlyRetained(t *testing.T) {
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
	require.Equal(t, uint64(2), publish("live"))
	for i := range 3 * KeptEpochs { // other epochs, each released once and its actor stopped
		require.Equal(t, uint64(1), publish(fmt.Sprintf("old%d", i)))
		r.Retain(fmt.Sprintf("old%d", i))
	}
	require.Equal(t, uint64(3), publish("live"), "an epoch in use is never dropped")
	r.mu.Lock()
	kept, retained := len(r.counts), len(r.retained)
	r.mu.Unlock()
	require.Equal(t, KeptEpochs+1, kept)
	require.Equal(t, KeptEpochs, retained)

	last := fmt.Sprintf("old%d", 3*KeptEpochs-1)
	require.Equal(t, uint64(2), publish(last), "a retained epoch goes on when used again")
	for i := range KeptEpochs {
		r.Retain(fmt.Sprintf("new%d", i)) // no count: nothing to keep
	}
	for i := range 2 * KeptEpochs {
		publish(fmt.Sprintf("more%d", i))
		r.Retain(fmt.Sprintf("more%d", i))
	}
	require.Equal(t, uint64(3), publish(last), "used again, it is not retained: kept")
	require.Equal(t, uint64(1), publish("old0"), "a dropped epoch starts again")
	r.Forget(last)
	require.Equal(t, uint64(1), publish(last), "Forget drops it at once")
}

// An epoch retained again (an actor that went on with it has stopped too)
// becomes the most recently retained: the epochs retained before it go
// first.
func TestAnEpochRetainedAgainIsTheMostRecent(t *testing.T) {
	_, nc := testkit.NATS(t)
	testkit.Subscribe(t, nc, "kvactors.e1.released")
	r := NewReleases(NewOutbox(nc, "kvactors", slog.New(slog.NewTextHandler(io.Discard, nil))), "e1")
	for i := range KeptEpochs + 1 {
		require.True(t, r.Publish(context.Background(), fmt.Sprint("e", i), "r", messages.ReasonFinished, nil))
	}
	r.Retain("e0")
	for i := 1; i < KeptEpochs; i++ {
		r.Retain(fmt.Sprint("e", i))
	}
	r.Retain("e0") // again, last
	r.Retain(fmt.Sprint("e", KeptEpochs))
	r.mu.Lock()
	defer r.mu.Unlock()
	require.Contains(t, r.counts, "e0", "retained last but one: kept")
	require.NotContains(t, r.counts, "e1", "the oldest retained went")
}

// A release handed off before its actor stopped (a failed request's,
// published by the copy queue once its copies end) may come after the
// actor retained the epoch: it must leave the epoch retained, within
// KeptEpochs. Taken for a new use, each such epoch was kept for the boot.
func TestAHandedOffReleaseLeavesItsEpochRetained(t *testing.T) {
	_, nc := testkit.NATS(t)
	r := NewReleases(NewOutbox(nc, "kvactors", slog.New(slog.NewTextHandler(io.Discard, nil))), "e1")
	ctx := context.Background()
	for i := range 100 {
		ep := fmt.Sprintf("ep%d", i)
		r.Publish(ctx, ep, "a", messages.ReasonFinished, nil)         // the actor's own release
		r.Retain(ep)                                                  // its Stopped
		r.PublishHandedOff(ctx, ep, "f", messages.ReasonAborted, nil) // the hand-off's, after
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	require.LessOrEqual(t, len(r.counts), KeptEpochs)
	require.Len(t, r.retained, len(r.counts))
	require.EqualValues(t, 2, r.counts["ep99"].n, "the hand-off's release numbered after the actor's")
}
