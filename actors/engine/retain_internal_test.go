package engine

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/actors"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/sched"
)

// A stopping actor retains its own epoch last, after the ended ones it
// still kept: a successor going on with that epoch (an engine that keeps
// it across a re-register) may not have released in it yet, and however
// many ended epochs the stop retains, they do not push its count out and
// restart its rseq (which the engine would drop as duplicates).
func TestAStoppingActorRetainsItsOwnEpochLast(t *testing.T) {
	_, nc := testkit.NATS(t)
	released := testkit.Subscribe(t, nc, "kvactors.e1.released")
	r := actors.NewReleases(actors.NewOutbox(nc, "kvactors", slog.New(slog.NewTextHandler(io.Discard, nil))), "e1")
	publish := func(epoch string) uint64 {
		t.Helper()
		require.True(t, r.Publish(context.Background(), epoch, "r", messages.ReasonFinished, nil))
		var rel messages.Released
		require.NoError(t, json.Unmarshal(testkit.Recv(t, released, 5*time.Second, "a release").Data, &rel))
		return rel.RSeq
	}
	now := time.Now()
	a := &Actor{deps: Deps{Releases: r}, seq: sched.NewSequencer(now, time.Minute), perEpoch: map[string]int{}}
	a.seq.Batch(now, "X", 1)
	require.Equal(t, "X", a.seq.Epoch())
	for range 3 {
		publish("X")
	}
	for i := range actors.KeptEpochs {
		epoch := fmt.Sprint("old", i)
		publish(epoch)
		a.forgetLater = append(a.forgetLater, epoch)
	}
	a.forgetLater = append(a.forgetLater, "X") // its own may wait to be forgotten too
	a.retainEpochs()
	require.Equal(t, uint64(4), publish("X"), "the successor's release goes on with the epoch's rseq")
}
