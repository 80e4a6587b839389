package node_test

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/node"
)

// The black-box tests of PROTOCOL.md v2 "Sessions" and "Delivery": each
// drives the node over NATS as an engine would and checks what comes back.

func (te *testEngine) heartbeat(epoch string, seq uint64) messages.HeartbeatReply {
	te.e.t.Helper()
	var r messages.HeartbeatReply
	require.NoError(te.e.t, json.Unmarshal(te.request("heartbeat", messages.HeartbeatRequest{Epoch: epoch, Seq: seq}), &r))
	return r
}

// storeOne sends one request whose single chunk is stored; it waits for the
// stored message.
func (te *testEngine) storeOne(req string, block int) {
	te.e.t.Helper()
	te.send(added(req, 4), hashesEv(req, 0, hash(req, 0)), blocksEv(req, 0, 0, block), tokensEv(req, 4, 4))
	require.Equal(te.e.t, req, recv(te.e.t, te.stored, "stored of "+req).Request)
}

func dropped(t *testing.T, e *env, reason string) float64 {
	return metricValue(t, e.reg, "kvactors_dropped_batches_total", map[string]string{"reason": reason})
}

func resyncs(t *testing.T, e *env, reason string) float64 {
	return metricValue(t, e.reg, "kvactors_resyncs_total", map[string]string{"reason": reason})
}

// Sessions: node and boot in every reply (register, lookup, load, status,
// heartbeat, errors); AllBlocksCleared only at the first register in a boot;
// engine ids starting with _ are reserved.
func TestEveryReplyNamesNodeAndBoot(t *testing.T) {
	t.Parallel()
	e := startNode(t, func(c *node.Config) { c.NodeID = "n-1" })
	require.Equal(t, "n-1", e.node.NodeID())
	require.Len(t, e.node.Boot(), 16)
	te := e.newEngine("e1", defaultOpts())
	te.register() // checks the reply and AllBlocksCleared first
	te.register() // identical spec: a no-op, and no second AllBlocksCleared
	te.storeOne("r1", 3)
	kv := recv(t, te.kv, "BlockStored")
	require.Equal(t, messages.KVBlockStored, kv.Events[0].Type, "AllBlocksCleared is published once per boot")

	want := map[string]any{"node": "n-1", "boot": e.node.Boot()}
	for _, c := range []struct {
		verb string
		body any
	}{
		{"lookup", map[string]any{"hashes": []string{hash("r1", 0)}}},
		{"lookup", map[string]any{"hashes": "not a list"}},
		{"load", map[string]any{"request": "x", "hashes": []string{hash("r1", 0)}, "num_tokens": 4, "blocks": [][]int{{9}}}},
		{"load", map[string]any{"request": "x", "hashes": []string{hash("zz", 0)}, "num_tokens": 4, "blocks": [][]int{{9}}}},
		{"status", map[string]any{}},
		{"heartbeat", messages.HeartbeatRequest{Epoch: "ep1", Seq: 1}},
		{"register", map[string]any{"tokens_per_hash": -1}},
	} {
		var got map[string]any
		require.NoError(t, json.Unmarshal(te.request(c.verb, c.body), &got))
		for k, v := range want {
			require.Equal(t, v, got[k], "%s reply %v", c.verb, got)
		}
	}

	// Unknown engine: an error that still names the node.
	other := e.newEngine("nobody", defaultOpts())
	for _, verb := range []string{"heartbeat", "unregister", "lookup"} {
		var got map[string]any
		require.NoError(t, json.Unmarshal(other.request(verb, map[string]any{}), &got))
		require.Contains(t, got["error"], "unknown engine", verb)
		require.Equal(t, "n-1", got["node"], verb)
	}

	// PROTOCOL.md "Words": ids starting with _ are reserved.
	msg, err := e.nc.Request("kvactors._e.register", []byte(`{}`), 5*time.Second)
	require.NoError(t, err)
	require.Contains(t, string(msg.Data), "reserved")
	require.NotContains(t, e.node.Engines(), "_e")
}

// Sessions: released carries the epoch whose events it answers and rseq
// 1, 2, … per epoch; a request of an old epoch released after a new epoch
// began carries the old epoch and the old epoch's numbering. The heartbeat
// reply reports applied and released for the epoch asked about.
func TestReleasedEpochRseqAndHeartbeatCounts(t *testing.T) {
	t.Parallel()
	e := startNode(t)
	te := e.newEngine("e1", defaultOpts())
	raw := testkit.Subscribe(t, e.nc, "kvactors.e1.released")
	te.register()
	te.storeOne("a", 1)
	te.storeOne("b", 2)
	te.send(finishedEv("a", false, 4, 4))
	te.send(finishedEv("ghost", false, 0, 0)) // unknown request: released at once
	for range 2 {
		recv(t, te.released, "release")
	}
	hb := te.heartbeat("ep1", te.seq)
	require.Equal(t, messages.HeartbeatReply{Node: e.node.NodeID(), Boot: e.node.Boot(), Epoch: "ep1",
		Applied: te.seq, Released: 2}, hb)

	te.epoch, te.seq = "ep2", 0
	te.send(added("c", 4), finishedEv("c", true, 0, 4))
	var got []messages.Released
	for range 4 {
		var r messages.Released
		require.NoError(t, json.Unmarshal(testkit.Recv(t, raw, 5*time.Second, "raw release").Data, &r))
		got = append(got, r)
	}
	// a (a request actor) and ghost (the engine actor) race for rseq 1.
	require.ElementsMatch(t, []string{"a", "ghost"}, []string{got[0].Request, got[1].Request})
	for i, r := range got[:2] {
		require.Equal(t, messages.Released{Request: r.Request, Epoch: "ep1", RSeq: uint64(i + 1), Reason: "finished"}, r)
	}
	require.ElementsMatch(t, []messages.Released{
		{Request: "b", Epoch: "ep1", RSeq: 3, Reason: "engine_reset"},
		{Request: "c", Epoch: "ep2", RSeq: 1, Reason: "aborted"},
	}, got[2:])
	hb = te.heartbeat("ep2", 1)
	require.Equal(t, uint64(1), hb.Applied)
	require.Equal(t, uint64(1), hb.Released)
	// An epoch the node has ended is answered with what it knows: nothing
	// applied in it now that it is not live.
	require.Equal(t, uint64(0), te.heartbeat("ep1", 3).Applied)
}

// The heartbeat's released count is never ahead of the releases already
// published: request actors release concurrently, yet a client that reads
// releases and heartbeat replies through one channel (so in wire order)
// always has at least `released` releases before the reply.
func TestHeartbeatReleasedNeverAheadOfDelivery(t *testing.T) {
	t.Parallel()
	e := startNode(t)
	te := e.newEngine("e1", engineOpts{tph: 4, bpc: 1, blocks: 512, tpb: []int{4}, kinds: []string{"full"}, blockBytes: 64})
	te.register()
	nc, err := nats.Connect(e.node.NATSURL())
	require.NoError(t, err)
	t.Cleanup(nc.Close)
	wire := make(chan *nats.Msg, 8192)
	_, err = nc.ChanSubscribe("kvactors.e1.released", wire)
	require.NoError(t, err)
	inbox := testkit.EngineInbox("e1")
	_, err = nc.ChanSubscribe(inbox, wire)
	require.NoError(t, err)
	require.NoError(t, nc.Flush())
	received, checked := 0, 0
	hbBody, _ := json.Marshal(messages.HeartbeatRequest{Epoch: "ep1"}) // seq 0: sent off the batches' connection
	const n = 300
	for i := range n {
		id := fmt.Sprintf("r%d", i)
		te.seq++
		body, _ := json.Marshal(map[string]any{"epoch": te.epoch, "seq": te.seq, "events": []map[string]any{
			added(id, 4), hashesEv(id, 0, hash(id, 0)), blocksEv(id, 0, 0, i+1), tokensEv(id, 4, 4),
			finishedEv(id, false, 4, 4)}})
		require.NoError(t, e.nc.Publish("kvactors.e1.events", body))
		if i%5 != 0 {
			continue
		}
		require.NoError(t, nc.PublishRequest("kvactors.e1.heartbeat", inbox, hbBody))
		for {
			m := testkit.Recv(t, wire, 5*time.Second, "a release or the heartbeat reply")
			if m.Subject != inbox {
				received++
				continue
			}
			var hb messages.HeartbeatReply
			require.NoError(t, json.Unmarshal(m.Data, &hb))
			require.Empty(t, hb.Error)
			require.LessOrEqual(t, hb.Released, uint64(received), "heartbeat counts releases not yet delivered")
			if hb.Released > 0 {
				checked++
			}
			break
		}
	}
	for received < n {
		testkit.Recv(t, wire, 5*time.Second, "release")
		received++
	}
	require.Positive(t, checked)
}

// Delivery: a seq jump is never applied. The node resyncs (expected, got,
// reason gap), drops and counts the epoch's later batches until a new
// epoch, then serves normally.
func TestSeqJumpResyncsAndDropsUntilNewEpoch(t *testing.T) {
	t.Parallel()
	e := startNode(t)
	te := e.newEngine("e1", defaultOpts())
	te.register()
	te.storeOne("a", 1)
	te.seq++ // batch 2 is lost
	te.send(finishedEv("a", false, 4, 4))
	rs := recv(t, te.resync, "resync")
	require.Equal(t, messages.Resync{Node: e.node.NodeID(), Boot: e.node.Boot(), Epoch: "ep1", Expected: 2, Got: 3,
		Reason: "gap"}, rs)
	te.send(added("b", 4))
	te.seq = 1
	te.send(added("c", 4)) // even the missing batch is not applied now
	st := te.sync()
	require.True(t, st.Resyncing)
	require.Equal(t, uint64(1), st.Seq)
	require.Len(t, st.Requests, 1, "nothing of the gapped epoch applied")
	require.Equal(t, 3.0, dropped(t, e, "gap"))
	require.Equal(t, 1.0, resyncs(t, e, "gap"), "later batches within lease/4 repeat nothing")
	none(te, te.released, "release of a gapped batch's finished")

	te.epoch, te.seq = "ep2", 0
	te.storeOne("d", 4)
	require.Equal(t, messages.Released{Request: "a", Reason: "engine_reset"}, recv(t, te.released, "old epoch reset"))
	te.send(finishedEv("d", false, 4, 4))
	require.Equal(t, messages.Released{Request: "d", Reason: "finished"}, recv(t, te.released, "release"))
	require.False(t, te.sync().Resyncing)
}

// Delivery (v2): the first batch of an epoch must have seq 1 — a node that
// restarted must not pick up an old epoch midway.
func TestFirstBatchOfEpochMustBeSeqOne(t *testing.T) {
	t.Parallel()
	e := startNode(t)
	te := e.newEngine("e1", defaultOpts())
	te.register()
	te.seq = 41
	te.send(added("a", 4))
	require.Equal(t, messages.Resync{Node: e.node.NodeID(), Boot: e.node.Boot(), Epoch: "ep1", Expected: 1, Got: 42,
		Reason: "gap"}, recv(t, te.resync, "resync"))
	require.Empty(t, te.sync().Requests)
	te.epoch, te.seq = "ep2", 0
	te.storeOne("a", 2)
}

// Delivery: a heartbeat whose seq is beyond the last applied batch reveals a
// lost tail; the node resyncs.
func TestLostTailSeenByHeartbeat(t *testing.T) {
	t.Parallel()
	e := startNode(t)
	te := e.newEngine("e1", defaultOpts())
	te.register()
	te.storeOne("a", 1)
	hb := te.heartbeat("ep1", 2) // batch 2 never arrived
	require.Equal(t, uint64(1), hb.Applied)
	require.Equal(t, messages.Resync{Node: e.node.NodeID(), Boot: e.node.Boot(), Epoch: "ep1", Expected: 2, Got: 2,
		Reason: "gap"}, recv(t, te.resync, "resync"))
	te.seq = 2
	te.send(finishedEv("a", false, 4, 4)) // the lost batch, resent late: too late
	require.True(t, te.sync().Resyncing)
	none(te, te.released, "release")
}

// Delivery: the resync repeats while batches of the epoch keep arriving, at
// most once per lease/4, so a lost resync cannot leave the engine talking to
// a wall.
func TestResyncRepeatsRateLimited(t *testing.T) {
	// Not shorter: a node with no NATS round trip for 3/4 lease lapses and
	// orders a resync of its own (reason reconnect); at 400 ms one came 31 ms
	// after the gap's under two -race suites, and read as an early repeat.
	const lease = 1200 * time.Millisecond
	e := startNode(t, func(c *node.Config) { c.Lease = lease })
	te := e.newEngine("e1", defaultOpts())
	te.register()
	te.seq = 5
	start := time.Now()
	te.send(added("a", 4))
	gap := messages.Resync{Node: e.node.NodeID(), Boot: e.node.Boot(), Epoch: "ep1", Expected: 1, Got: 6, Reason: "gap"}
	require.Equal(t, gap, recv(t, te.resync, "first resync"))
	sent := 1
	var second messages.Resync
	testkit.Eventually(t, 5*time.Second, 5*time.Millisecond, func() error {
		select {
		case second = <-te.resync:
			return nil
		default:
		}
		te.send(added("a", 4))
		sent++
		return fmt.Errorf("no repeat yet")
	})
	elapsed := time.Since(start)
	require.Equal(t, gap, second, "the gap's order repeated (fence lapses %v)",
		metricValue(t, e.reg, "kvactors_transfer_fence_lapses_total", nil))
	require.GreaterOrEqual(t, elapsed, lease/4, "repeated before lease/4")
	// Batches every 5ms for the whole time, yet at most one resync per lease/4.
	require.LessOrEqual(t, resyncs(t, e, "gap"), 1+float64(time.Since(start)/(lease/4)))
	require.Greater(t, sent, 5)
}

// Sessions: P.E.unregister releases every request once with engine_gone
// (queued copies cancelled, in-flight finished first), unmaps the engine's
// segments (checked in /proc/self/maps) and frees its state; stored chunks
// stay in the pool.
func TestUnregisterReleasesOnceAndUnmaps(t *testing.T) {
	t.Parallel()
	e := startNode(t)
	te := e.newEngine("e1", defaultOpts())
	te.register()
	path := filepath.Join(e.dir, te.spec.Segments[0].Shm)
	require.True(t, mapped(t, path), "segment mapped after register")
	te.storeOne("a", 1)
	te.send(added("b", 8), blocksEv("b", 0, 0, 2, 3), hashesEv("b", 0, hash("b", 0))) // deferred: no tokens
	te.send(added("c", 4))                                                            // no blocks at all
	te.sync()

	var r messages.UnregisterReply
	require.NoError(t, json.Unmarshal(te.request("unregister", map[string]any{}), &r))
	require.Equal(t, messages.UnregisterReply{OK: true, Released: 3, Node: e.node.NodeID(), Boot: e.node.Boot()}, r)
	got := map[string]string{}
	for range 3 {
		rel := recv(t, te.released, "engine_gone release")
		require.NotContains(t, got, rel.Request, "released twice")
		got[rel.Request] = rel.Reason
	}
	require.Equal(t, map[string]string{"a": "engine_gone", "b": "engine_gone", "c": "engine_gone"}, got)
	require.False(t, mapped(t, path), "segment still mapped after the unregister reply")
	require.NotContains(t, e.node.Engines(), "e1")
	require.Equal(t, 1.0, metricValue(t, e.reg, "kvactors_engine_unregistered_total", nil))

	// The engine is unknown now; registering again (a fresh session) finds
	// its stored chunk still in the pool.
	msg, err := e.nc.Request("kvactors.e1.status", []byte(`{}`), 5*time.Second)
	require.NoError(t, err)
	require.Contains(t, string(msg.Data), "unknown engine")
	te.register()
	require.Equal(t, 4, te.lookup([]string{hash("a", 0)}))
	select {
	case rel := <-te.released:
		t.Fatalf("a second release after unregister: %+v", rel)
	default:
	}
	// rseq counts per engine per epoch for the whole boot: an engine that
	// comes back with the same epoch continues its numbering (the harness
	// checks rseq 4 here).
	te.seq = 0
	te.send(finishedEv("z", false, 0, 0))
	require.Equal(t, messages.Released{Request: "z", Reason: "finished"}, recv(t, te.released, "release after re-register"))
}

// mapped reports whether the node maps path: the test engine, in this same
// process, maps it once itself, so the node's mapping is a second one.
func mapped(t *testing.T, path string) bool {
	t.Helper()
	maps, err := os.ReadFile("/proc/self/maps")
	require.NoError(t, err)
	n := 0
	for _, line := range strings.Split(string(maps), "\n") {
		if strings.HasSuffix(line, " "+path) {
			n++
		}
	}
	require.Positive(t, n, "the test engine's own mapping of %s", path)
	return n > 1
}

// Sessions, "Engine liveness": an engine with no sign of life for a lease
// expires exactly as if it had unregistered; one that heartbeats stays.
func TestSilentEngineExpires(t *testing.T) {
	t.Parallel()
	// A lease long enough that the heartbeating engine's first beat comes
	// well within it on a loaded machine; it registers after the silent
	// engine's store, so nothing slow runs between its register and the
	// polls that keep it alive.
	const lease = time.Second
	e := startNode(t, func(c *node.Config) { c.Lease = lease })
	silent := e.newEngine("silent", defaultOpts())
	alive := e.newEngine("alive", defaultOpts())
	silent.register()
	path := filepath.Join(e.dir, silent.spec.Segments[0].Shm)
	silent.storeOne("a", 1)
	start := time.Now()
	alive.register()
	testkit.Eventually(t, 10*time.Second, lease/8, func() error {
		require.Empty(t, alive.heartbeat("ep1", 0).Error, "the heartbeating engine expired")
		if mapped(t, path) {
			return fmt.Errorf("silent engine's segment still mapped")
		}
		return nil
	})
	took := time.Since(start)
	// The last sign of life (the batch) came a little before start (its copy
	// and stored message took time), so expiry is a lease after the batch.
	require.GreaterOrEqual(t, took, lease/2, "expired long before the lease")
	t.Logf("silent engine expired and unmapped %v after its last sign of life (lease %v)", took, lease)
	require.Equal(t, messages.Released{Request: "a", Reason: "engine_gone"}, recv(t, silent.released, "release"))
	require.ElementsMatch(t, []string{"alive"}, e.node.Engines())
	require.Equal(t, 1.0, metricValue(t, e.reg, "kvactors_engine_expired_total", nil))
}

// Sessions: hello at start, then node heartbeats every lease/4 naming the
// engines served.
func TestNodeHelloAndHeartbeat(t *testing.T) {
	const lease = 200 * time.Millisecond
	e := startNode(t, func(c *node.Config) { c.Lease = lease; c.NodeID = "hb" })
	beats := make(chan messages.NodeHeartbeat, 64)
	subscribeJSON(t, e.nc, "kvactors._node.hb.heartbeat", beats)
	te := e.newEngine("e1", defaultOpts())
	te.register()
	testkit.Eventually(t, 5*time.Second, time.Millisecond, func() error {
		hb := recv(t, beats, "node heartbeat")
		require.Equal(t, "hb", hb.Node)
		require.Equal(t, e.node.Boot(), hb.Boot)
		if hb.Engines != 1 {
			return fmt.Errorf("heartbeat says %d engines", hb.Engines)
		}
		return nil
	})
	// The hello at start went out before this client subscribed; a restart
	// would send a new one with a new boot (TestExternalNATSAndReconnect
	// covers the hello after a reconnect).
}

// The node's one subscription (P.*.*) also sees what other nodes publish to
// engines; those are ignored, not counted as rejections.
func TestOtherNodesPublishesAreIgnored(t *testing.T) {
	t.Parallel()
	e := startNode(t, func(c *node.Config) { c.DecodeWorkers = 1 }) // one worker: status is a barrier for all
	te := e.newEngine("e1", defaultOpts())
	te.register()
	for _, verb := range []string{"released", "stored", "kv_events", "resync"} {
		require.NoError(t, e.nc.Publish("kvactors.e9."+verb, []byte(`{}`)))
	}
	require.NoError(t, e.nc.Publish("kvactors.e9.bogus", []byte(`{}`)))
	te.sync()
	require.Equal(t, 1.0, metricValue(t, e.reg, "kvactors_events_rejected_total", nil), "only the unknown verb")
	require.Equal(t, 1.0, rejected(t, e, "unknown_verb"))
}

// kvactors' choice, ordering: an engine's batches and heartbeats on one
// connection are handled in order, so a heartbeat sent right after a batch
// (without waiting) always finds it applied — never a false lost tail —
// even with several decode workers and other engines interleaved.
func TestHeartbeatRightAfterABatchNeverSeesAFalseGap(t *testing.T) {
	t.Parallel()
	e := startNode(t, func(c *node.Config) { c.DecodeWorkers = 4 })
	te := e.newEngine("e1", defaultOpts())
	other := e.newEngine("e2", defaultOpts())
	te.register()
	other.register()
	replies := make(chan *nats.Msg, 4096)
	inbox := testkit.EngineInbox("e1")
	_, err := e.nc.ChanSubscribe(inbox, replies)
	require.NoError(t, err)
	const n = 300
	for i := 1; i <= n; i++ {
		id := fmt.Sprintf("r%d", i)
		for _, x := range []*testEngine{te, other} {
			x.seq++
			body, _ := json.Marshal(map[string]any{"epoch": x.epoch, "seq": x.seq,
				"events": []map[string]any{added(id, 4), finishedEv(id, true, 0, 4)}})
			require.NoError(t, e.nc.Publish("kvactors."+x.id+".events", body))
		}
		hb, _ := json.Marshal(messages.HeartbeatRequest{Epoch: "ep1", Seq: te.seq})
		require.NoError(t, e.nc.PublishRequest("kvactors.e1.heartbeat", inbox, hb))
	}
	for i := 1; i <= n; i++ {
		var r messages.HeartbeatReply
		require.NoError(t, json.Unmarshal(testkit.Recv(t, replies, 5*time.Second, "heartbeat reply").Data, &r))
		require.Equal(t, uint64(i), r.Applied, "heartbeat %d", i)
	}
	none(te, te.resync, "a resync")
	require.Equal(t, 0.0, resyncs(t, e, "gap"))
}
