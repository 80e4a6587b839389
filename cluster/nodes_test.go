package cluster

import (
	"bytes"
	"encoding/json"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
)

// The survey joins heartbeats heard on one server with owners in the
// bucket: a live node with its usage, and an owner that sent nothing
// (its lease running out).
func TestSurveyListsLiveNodesAndSilentOwners(t *testing.T) {
	t.Parallel()
	c := testkit.NATSCluster(t, 3)
	ncA := c.Connect(0)
	a := openOwners(t, ncA, "gpu-0", "", 3)
	silent := openOwners(t, c.Connect(1), "gpu-1", "", 3)
	ctx := ctxT(t)
	for _, e := range []string{"e2", "e1"} {
		_, err := a.Resolve(ctx, e, Request{Register: true, Local: true})
		require.NoError(t, err)
	}
	_, err := silent.Resolve(ctx, "e9", Request{Register: true, Local: true})
	require.NoError(t, err)

	ncS := c.Connect(2)
	table, err := openOwners(t, ncS, "cli", "", 3).WatchOwners(ctx)
	require.NoError(t, err)
	t.Cleanup(table.Stop)
	testkit.Eventually(t, 5*time.Second, 10*time.Millisecond, func() error {
		if len(table.ByNode()["gpu-0"]) != 2 || len(table.ByNode()["gpu-1"]) != 1 {
			return fmt.Errorf("table not caught up: %v", table.ByNode())
		}
		return nil
	})
	// gpu-0 heartbeats (on s0) while the survey listens (on s2).
	hb, _ := json.Marshal(messages.NodeHeartbeat{Node: "gpu-0", Boot: "b0", Engines: 2,
		PoolBytes: 3 << 20, PoolCapacityBytes: 8 << 20})
	stopBeats := testkit.Every(t, 20*time.Millisecond, func() {
		_ = ncA.Publish(messages.NodeSubject("kvactors", "gpu-0", messages.NodeVerbHeartbeat), hb)
	})
	rows, err := Survey(ctx, ncS, "kvactors", table, 500*time.Millisecond)
	stopBeats()
	require.NoError(t, err)
	require.Len(t, rows, 2)
	require.Equal(t, "gpu-0", rows[0].Node)
	require.Equal(t, "b0", rows[0].Boot)
	require.Equal(t, []string{"e1", "e2"}, rows[0].Engines)
	require.Equal(t, 2, rows[0].Reported)
	require.GreaterOrEqual(t, rows[0].Age, time.Duration(0))
	require.Less(t, rows[0].Age, 500*time.Millisecond)
	require.Equal(t, NodeRow{Node: "gpu-1", Engines: []string{"e9"}, Reported: -1, Age: -1}, rows[1])

	var out bytes.Buffer
	require.NoError(t, WriteNodes(&out, rows))
	require.Contains(t, out.String(), "3.0MiB/8.0MiB")
	require.Contains(t, out.String(), "none (lease running out)")
	require.Contains(t, out.String(), "e1,e2")
}

// A heartbeat's lease_ms stretches the survey to that lease's heartbeat
// period (SurveyWait) from its start, however short the wait asked: a node
// heard says how often the others beat (no bucket to read it from, say).
func TestSurveyListensForTheHeardLeasesHeartbeatPeriod(t *testing.T) {
	t.Parallel()
	_, nc := testkit.NATS(t)
	const lease = time.Second
	hb, _ := json.Marshal(messages.NodeHeartbeat{Node: "gpu-0", Boot: "b0", LeaseMS: lease.Milliseconds()})
	stopBeats := testkit.Every(t, 5*time.Millisecond, func() {
		_ = nc.Publish(messages.NodeSubject("kvactors", "gpu-0", messages.NodeVerbHeartbeat), hb)
	})
	defer stopBeats()
	start := time.Now()
	rows, err := Survey(ctxT(t), nc, "kvactors", nil, 50*time.Millisecond)
	took := time.Since(start)
	require.NoError(t, err)
	require.Len(t, rows, 1)
	require.Equal(t, "gpu-0", rows[0].Node)
	require.GreaterOrEqual(t, took, SurveyWait(lease))
	require.Equal(t, 300*time.Millisecond, SurveyWait(lease), "lease/4 and a fifth of it again")
	require.Equal(t, 3*time.Second, SurveyWait(10*time.Second), "the former default --wait at the default lease")
	require.Equal(t, maxSurveyWait, SurveyWait(time.Hour), "bounded")
}
