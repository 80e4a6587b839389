package node_test

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"log/slog"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/cluster"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/node"
)

// One NATS server of the three stopped: the node and the engine that were
// on it reconnect to the others (learnt from the server's INFO), the owner
// keeps its claim (the bucket has three replicas), the engine resyncs and
// its requests are released once, a new engine is claimed, and a prefix
// stored before the stop still loads byte-identically through another node.
func TestClusterOneNATSServerStoppedStrandsNothing(t *testing.T) { // not parallel: restarts a NATS server on the ports it freed
	kc := &kvCluster{t: t, nats: testkit.NATSCluster(t, 3), dir: t.TempDir()}
	for i := range 3 {
		// Node i knows only server i: it must fail over by discovery.
		kc.nodes = append(kc.nodes, kc.startNode(i, fmt.Sprintf("n%d", i), func(s int, c *node.Config) {
			c.NATSURL = kc.nats.URL(s)
		}))
	}
	kc.waitSeen()
	// The engine's owner is the node on the server that leads the ownership
	// bucket's stream: stopping that server is the case the claim must ride
	// out (a clean stop hands the leadership over), not a follower's.
	o := -1
	testkit.Eventually(t, 10*time.Second, 20*time.Millisecond, func() error {
		for i := range 3 {
			if kc.nats.Server(i).JetStreamIsStreamLeader("$G", "KV_kvactors_owners") {
				o = i
				return nil
			}
		}
		return fmt.Errorf("no leader of the ownership bucket yet")
	})
	q := (o + 1) % 3 // a node on a server that stays
	owner, other := fmt.Sprintf("n%d", o), fmt.Sprintf("n%d", q)
	a := kc.engineOn(o, "ea", "m")
	a.register()
	hs := []string{hash("s", 0), hash("s", 1)}
	a.storePrefix("r1", hs, 30, 31, 5, "stored before the stop")
	a.send(added("r2", 8), hashesEv("r2", 0, hash("t", 0), hash("t", 1)), blocksEv("r2", 0, 0, 32, 33), tokensEv("r2", 8, 8))
	recv(t, a.stored, "r2 stored before the stop")

	require.True(t, kc.nats.Server(o).JetStreamIsStreamLeader("$G", "KV_kvactors_owners"), "the stopped server leads the bucket")
	kc.nats.Stop(o)
	stopped := time.Now()
	testkit.Eventually(t, 15*time.Second, 20*time.Millisecond, func() error {
		if kc.nodes[o].counter("kvactors_nats_events_total", "reconnect") < 1 {
			return fmt.Errorf("node %s has not reconnected", owner)
		}
		if err := kc.nodes[o].node.Ready(); err != nil {
			return fmt.Errorf("node %s: %w", owner, err)
		}
		if !a.e.nc.IsConnected() || a.e.nc.Stats().Reconnects < 1 {
			return fmt.Errorf("engine not reconnected")
		}
		return nil
	})
	t.Logf("node %s reconnected %v after its server stopped", owner, time.Since(stopped))
	// n0 resyncs its engine after the reconnect; the engine starts a new
	// epoch and re-announces its live request.
	var rs messages.Resync
	testkit.Eventually(t, 10*time.Second, 50*time.Millisecond, func() error {
		select {
		case rs = <-a.resync:
			return nil
		default:
			a.send(added("lost", 4)) // a batch of the old epoch asks for the resync again
			return fmt.Errorf("no resync yet")
		}
	})
	require.Equal(t, owner, rs.Node, "the same node, still the owner")
	require.Equal(t, kc.nodes[o].node.Boot(), rs.Boot)
	// The claim survived: n0 still answers the engine's heartbeats (which
	// keep its engine lease) one and a half ownership leases after the stop,
	// so it renewed its claim after the stop (it serves only within a lease
	// of its last successful write).
	testkit.Eventually(t, 5*time.Second, 50*time.Millisecond, func() error {
		var hb messages.HeartbeatReply
		if err := jsonUnmarshal(a.request("heartbeat", messages.HeartbeatRequest{Epoch: a.epoch, Seq: a.seq}), &hb); err != nil {
			return err
		}
		require.Equal(t, owner, hb.Node)
		if d := time.Since(stopped); d < clusterLease+clusterLease/2 {
			return fmt.Errorf("only %v since the stop", d)
		}
		return nil
	})
	require.Equal(t, []string{"ea"}, kc.nodes[o].node.Engines(), "the owner kept its engine")
	require.Zero(t, kc.nodes[o].counter("kvactors_cluster_ownership_fenced_total", ""), "no keep-alive lost its claim")
	a.epoch, a.seq = "ep2", 0
	a.send(added("r2", 8), hashesEv("r2", 0, hash("t", 0), hash("t", 1)), blocksEv("r2", 0, 0, 32, 33), tokensEv("r2", 8, 8))
	a.send(finishedEv("r2", false, 8, 8))
	// The old epoch's requests are released once (engine_reset, the new
	// epoch re-announced r2), then r2 of the new epoch once (finished).
	var got []messages.Released
	for range 3 {
		got = append(got, recv(t, a.released, "release"))
	}
	require.ElementsMatch(t, []messages.Released{{Request: "r1", Reason: "engine_reset"},
		{Request: "r2", Reason: "engine_reset"}, {Request: "r2", Reason: "finished"}}, got)
	none(a, a.released, "a further release")

	// An engine registered after the stop (the bucket lost a replica) is
	// claimed, and the prefix stored before the stop loads through n2.
	c := kc.engineOn(q, "ec", "m")
	c.register()
	awaitLookup(t, c, hs, 8, other)
	r := c.loadInto("rc", hs, 8, []int{1, 2})
	require.True(t, r.OK, r.Error)
	require.Equal(t, 2, r.RemoteChunks)
	require.True(t, bytes.Equal(a.block(0, 30), c.block(0, 1)))
	require.True(t, bytes.Equal(a.block(0, 31), c.block(0, 2)))
}

// --cluster without --nats: the embedded server runs JetStream (off
// otherwise), the node claims its engine in a one-replica bucket and serves
// it as a single node would.
func TestClusterOnTheEmbeddedServer(t *testing.T) {
	e := startNode(t, func(c *node.Config) { c.Cluster, c.Lease = true, time.Second })
	te := e.newEngine("e1", defaultOpts())
	te.register()
	te.storeOne("a", 1)
	require.Equal(t, 1.0, e.counter("kvactors_cluster_ownership_decisions_total", "claim"))
	js, err := jetstream.New(e.nc)
	require.NoError(t, err)
	kv, err := js.KeyValue(context.Background(), "kvactors_owners")
	require.NoError(t, err)
	rec, err := kv.Get(context.Background(), "e1")
	require.NoError(t, err)
	require.Contains(t, string(rec.Value()), `"node":"`+e.node.NodeID()+`"`)
}

// A node whose --lease differs from the ownership bucket's (made by the
// cluster's first node) is refused as a configuration error (serve exits
// 2) naming the setting, not as JetStream missing.
func TestClusterNodeWithAnotherLeaseIsAConfigError(t *testing.T) {
	e := startNode(t, func(c *node.Config) { c.Cluster, c.Lease = true, time.Second })
	n, err := node.Start(context.Background(), node.Config{NATSURL: e.node.NATSURL(), NodeID: "other", Cluster: true,
		Lease: 2 * time.Second, ShmDir: t.TempDir(), PoolBytes: 1 << 20, HTTPAddr: node.HTTPOff,
		Registry: prometheus.NewRegistry(), Log: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err == nil {
		_ = n.Close(context.Background())
	}
	require.ErrorIs(t, err, node.ErrConfig)
	require.ErrorIs(t, err, cluster.ErrConfig)
	// Said once: not "bad config: cluster: bad config: …", and not the
	// server's refusal after it (two more lines saying "already in use").
	require.EqualError(t, err, "cluster: bad config: ownership bucket kvactors_owners exists with lease 1s, "+
		"not this node's 2s (--lease): every node of a cluster takes the bucket's (docs/CLUSTER.md)")
}

// Fencing: another writer replaces the owner's record (as a node that took
// the engine over after a partition would). The owner's next keep-alive
// fails its compare-and-set; it drops the engine at once (its live request
// released once, engine_gone) and answers nothing more for it.
func TestClusterFencedOwnerDropsItsEngine(t *testing.T) {
	t.Parallel()
	kc := startCluster(t, 2)
	te := kc.nodes[0].newEngine("e1", defaultOpts())
	te.spec.Node = "n0"
	te.register()
	te.storeOne("live", 3)
	js, err := jetstream.New(kc.nodes[1].nc)
	require.NoError(t, err)
	kv, err := js.KeyValue(context.Background(), "kvactors_owners")
	require.NoError(t, err)
	_, err = kv.Put(context.Background(), "e1", []byte(`{"node":"n9","boot":"b9","lease_ms":2000}`))
	require.NoError(t, err)
	testkit.Eventually(t, 2*clusterLease, 10*time.Millisecond, func() error {
		if len(kc.nodes[0].node.Engines()) != 0 {
			return fmt.Errorf("n0 still serves e1")
		}
		return nil
	})
	require.Equal(t, 1.0, kc.nodes[0].counter("kvactors_cluster_ownership_fenced_total", ""))
	require.Equal(t, messages.Released{Request: "live", Reason: "engine_gone"}, recv(t, te.released, "release of the live request"))
	testkit.NoRecv(t, te.released, 300*time.Millisecond, "a second release")
	replies := collect(t, kc.nodes[0].nc, "kvactors.e1.lookup", map[string]any{"hashes": []string{hash("x", 0)}})
	testkit.NoRecv(t, replies, 300*time.Millisecond, "an answer from a fenced or foreign node")
}

// Cluster settings are checked before anything starts.
func TestClusterConfigIsChecked(t *testing.T) {
	for name, c := range map[string]node.Config{
		"standby for itself":     {NodeID: "a", StandbyFor: "a"},
		"standby for a bad id":   {NodeID: "a", StandbyFor: "_x"},
		"lease under 1s":         {NodeID: "a", Cluster: true, Lease: 500 * time.Millisecond},
		"replicas over 5":        {NodeID: "a", Cluster: true, ClusterReplicas: 7},
		"negative fetch timeout": {NodeID: "a", Cluster: true, FetchTimeout: -time.Second},
		"a bucket with a dot":    {NodeID: "a", Cluster: true, ClusterBucket: "a.b"},
		"a bucket with a space":  {NodeID: "a", Cluster: true, ClusterBucket: "a b"},
		"a bucket with a star":   {NodeID: "a", Cluster: true, ClusterBucket: "own*"},
	} {
		require.ErrorIs(t, c.Validate(), node.ErrConfig, name)
	}
	require.EqualError(t, node.Config{NodeID: "a", Cluster: true, ClusterReplicas: 7}.Validate(),
		"cluster: bad config: --cluster-replicas 7: want 1..5", "bad config said once")
	require.NoError(t, node.Config{NodeID: "a", StandbyFor: "b"}.Validate())
	require.NoError(t, node.Config{NodeID: "a", Cluster: true, ClusterBucket: "Own-ers_2"}.Validate())
	require.NoError(t, node.Config{NodeID: "a", Lease: 500 * time.Millisecond}.Validate(), "no cluster: any lease")
	require.True(t, node.Config{StandbyFor: "b"}.Clustered(), "--standby-for implies --cluster")
}
