//go:build chaos

package request_test

import (
	"encoding/json"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/hostpool"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/sched"
)

// A finished request the pool never has room for, woken every 5 ms (room
// that others take as it frees), still gives up once its timers have spent
// FinishRetryLimit attempts (about 10.3 s of backoff) and is released,
// finished, its chunk counted as dropped (docs/PROTOCOL.md: "giving up
// still takes about 10 s, however often it is woken"). Before a woken
// retry took over the running timer, each wake-up restarted the backoff and
// the request was never released. Waits out the whole backoff: chaos-tagged.
func TestAFinishedRequestWokenForRoomStillGivesUp(t *testing.T) {
	_, nc := testkit.NATS(t)
	released := testkit.Subscribe(t, nc, "kvactors.e.released")
	rig, rs := finishedWithNoRoom(t, nc)
	testkit.Every(t, 5*time.Millisecond, func() { // the room queue's wake-ups, as room frees and others take it
		rs.mu.Lock()
		ws := rs.room
		rs.room = nil
		rs.mu.Unlock()
		for _, w := range ws {
			if sw, ok := w.(hostpool.StaleWaker); !ok || !sw.Stale() {
				w.Wake()
			}
		}
	})
	var rel messages.Released
	require.NoError(t, json.Unmarshal(testkit.Recv(t, released, 20*time.Second, "r1 released").Data, &rel))
	require.Equal(t, "r1", rel.Request)
	require.Equal(t, "finished", rel.Reason)
	require.Equal(t, 1.0, testutil.ToFloat64(rig.store.ChunksDropped), "its chunk given up")
	require.Greater(t, testutil.ToFloat64(rig.store.Retries.WithLabelValues("pool_full")), float64(sched.FinishRetryLimit),
		"woken more often than its timers fell due")
}
