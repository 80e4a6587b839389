package node_test

import (
	"context"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"log/slog"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/backend/shm"
	"github.com/kvactors/kvactors/internal/tailbuf"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/node"
)

// env is one node plus a NATS client, both torn down at cleanup.
type env struct {
	t    *testing.T
	node *node.Node
	nc   *nats.Conn
	reg  *prometheus.Registry
	dir  string
}

func startNode(t *testing.T, mutate ...func(*node.Config)) *env {
	t.Helper()
	dir := t.TempDir()
	reg := prometheus.NewRegistry()
	// The node's warnings, printed if the test fails (a lapse, an expiry,
	// a resync: what a timing failure needs explained).
	warned := &tailbuf.Buffer{Max: 64 << 10}
	t.Cleanup(func() { // registered first: runs after the node's Close
		if t.Failed() {
			t.Logf("the node warned:\n%s", warned.String())
		}
	})
	cfg := node.Config{NATSPort: -1, NATSStoreDir: t.TempDir(), ShmDir: dir, PoolBytes: 1 << 20, HTTPAddr: "127.0.0.1:0",
		Registry: reg, Log: slog.New(slog.NewTextHandler(warned, &slog.HandlerOptions{Level: slog.LevelWarn})),
		// A fail-stop fails the test, not the whole binary (the default
		// exits the process); a test that expects one sets its own.
		FailStop: func(reason string) { t.Errorf("the node fail-stopped: %s", reason) }}
	for _, m := range mutate {
		m(&cfg)
	}
	n, err := node.Start(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(func() { checkDocumentedLabelValues(t, reg) }) // after the Close below: its releases included
	t.Cleanup(func() { _ = n.Close(context.Background()) })
	nc, err := nats.Connect(n.NATSURL())
	require.NoError(t, err)
	t.Cleanup(nc.Close)
	return &env{t: t, node: n, nc: nc, reg: reg, dir: dir}
}

// silenceNotTested gives a node a lease that outlasts any run, for a test
// whose engines send no sign of life while a flood, huge bodies or the GCs
// they cause run: under -race on a loaded machine those outlast the default
// lease's lease/2 (5 s), and the node would then reset the engine's requests
// and refuse its loads, as PROTOCOL.md "Engine silence" says (seen: 6.7 s
// silent, load average 20). Silence is not what such a test is about.
func silenceNotTested(c *node.Config) { c.Lease = 10 * time.Minute }

// testEngine is a scripted engine: one shm segment, one region per group,
// block b of group g filled with a pattern that names (engine, g, b, gen).
type testEngine struct {
	e        *env
	id       string
	spec     messages.EngineSpec
	seg      *shm.Segment
	blockLen int64
	epoch    string
	seq      uint64
	released chan messages.Released // epoch and rseq checked, then cleared
	// subs are released, resync, stored and kv_events' subscriptions (none)
	subs   []*watchedSub
	stored chan messages.Stored
	kv     chan messages.KVEventBatch
	kvLeft []messages.KVEvent // events recvKV received and has not returned
	resync chan messages.Resync
	// rseqs is the last rseq seen per epoch (the subscription's handler's).
	rseqs map[string]uint64
	// rseqKeep, when set, keeps the rseqs of that many epochs, the latest
	// (rseqOrder: the handler's), for a test that begins epochs without
	// end and counts heap objects.
	rseqKeep   atomic.Int32
	rseqOrder  []string
	registered bool
}

type engineOpts struct {
	tph, bpc, blocks int
	tpb              []int // tokens per block per group
	kinds            []string
	window           int
	blockBytes       int64
}

func defaultOpts() engineOpts {
	return engineOpts{tph: 4, bpc: 1, blocks: 64, tpb: []int{4}, kinds: []string{"full"}, blockBytes: 256}
}

func (e *env) newEngine(id string, o engineOpts) *testEngine {
	t := e.t
	t.Helper()
	groupBytes := int64(o.blocks) * o.blockBytes
	seg, err := shm.Create(e.dir, id+"-seg", groupBytes*int64(len(o.tpb)))
	require.NoError(t, err)
	t.Cleanup(func() { _ = seg.Remove() })
	spec := messages.EngineSpec{TokensPerHash: o.tph, BlocksPerChunk: o.bpc, NumGPUBlocks: o.blocks,
		Segments: []messages.Segment{{Shm: seg.Name()}}}
	for g, tpb := range o.tpb {
		kind := "full"
		if g < len(o.kinds) {
			kind = o.kinds[g]
		}
		gs := messages.GroupSpec{Kind: kind, TokensPerBlock: tpb,
			Regions: []messages.Region{{Segment: 0, Offset: int64(g) * groupBytes, BlockStride: o.blockBytes, BlockBytes: o.blockBytes}}}
		if kind == "sliding_window" {
			gs.SlidingWindow = o.window
		}
		spec.Groups = append(spec.Groups, gs)
	}
	te := &testEngine{e: e, id: id, spec: spec, seg: seg, blockLen: o.blockBytes, epoch: "ep1",
		released: make(chan messages.Released, 1024), stored: make(chan messages.Stored, 1024),
		kv: make(chan messages.KVEventBatch, 1024)}
	te.resync = make(chan messages.Resync, 1024)
	te.rseqs = map[string]uint64{}
	// PROTOCOL.md v2: every release names its epoch, and rseq counts 1, 2,
	// … per epoch with no hole and no repeat. Checked in the subscription's
	// handler itself (its goroutine alone touches rseqs): a goroutine of
	// its own outlived the test, and its extra hop let a check for no
	// release (none) run before a release already received was passed on.
	relSub := &watchedSub{}
	sub, err := e.nc.Subscribe("kvactors."+id+".released", func(m *nats.Msg) {
		defer relSub.handled.Add(1)
		var r messages.Released
		if err := json.Unmarshal(m.Data, &r); err != nil {
			t.Errorf("released: bad body %q: %v", m.Data, err)
			return
		}
		if r.Epoch == "" || r.RSeq != te.rseqs[r.Epoch]+1 {
			t.Errorf("release %+v: want epoch set and rseq %d", r, te.rseqs[r.Epoch]+1)
		}
		if _, ok := te.rseqs[r.Epoch]; !ok && te.rseqKeep.Load() > 0 {
			te.rseqOrder = append(te.rseqOrder, r.Epoch)
			for len(te.rseqOrder) > int(te.rseqKeep.Load()) {
				delete(te.rseqs, te.rseqOrder[0])
				te.rseqOrder = te.rseqOrder[1:]
			}
		}
		te.rseqs[r.Epoch] = r.RSeq
		r.Epoch, r.RSeq = "", 0
		te.released <- r
	})
	require.NoError(t, err)
	t.Cleanup(func() { _ = sub.Unsubscribe() })
	relSub.sub = sub
	te.subs = []*watchedSub{relSub,
		subscribeJSON(t, e.nc, "kvactors."+id+".resync", te.resync),
		subscribeJSON(t, e.nc, "kvactors."+id+".stored", te.stored),
		subscribeJSON(t, e.nc, "kvactors."+id+".kv_events", te.kv)}
	require.NoError(t, e.nc.Flush())
	return te
}

// watchedSub is a subscription whose handler counts the messages it has
// finished with: none can tell a message still on its way to the channel
// (taken off the connection, its handler not done) from no message.
type watchedSub struct {
	sub     *nats.Subscription
	handled atomic.Int64
}

// settled reports whether every message the connection has handed the
// subscription went through its handler.
func (w *watchedSub) settled() error {
	pending, _, err := w.sub.Pending()
	if err != nil {
		return err
	}
	delivered, err := w.sub.Delivered()
	if err != nil {
		return err
	}
	if pending > 0 || w.handled.Load() != delivered {
		return fmt.Errorf("%s: %d pending, %d of %d delivered handled", w.sub.Subject, pending, w.handled.Load(), delivered)
	}
	return nil
}

func subscribeJSON[T any](t *testing.T, nc *nats.Conn, subject string, ch chan T) *watchedSub {
	t.Helper()
	w := &watchedSub{}
	sub, err := nc.Subscribe(subject, func(m *nats.Msg) {
		defer w.handled.Add(1)
		var v T
		if err := json.Unmarshal(m.Data, &v); err != nil {
			t.Errorf("%s: bad body %q: %v", subject, m.Data, err)
			return
		}
		ch <- v
	})
	require.NoError(t, err)
	t.Cleanup(func() { _ = sub.Unsubscribe() })
	w.sub = sub
	return w
}

// register registers the engine and checks the v2 reply; at the first
// register it also checks that AllBlocksCleared came before anything else on
// kv_events.
// unregister unregisters the engine and returns the node's reply, which
// must be ok.
func (te *testEngine) unregister() messages.UnregisterReply {
	te.e.t.Helper()
	var r messages.UnregisterReply
	require.NoError(te.e.t, json.Unmarshal(te.request("unregister", map[string]any{}), &r))
	require.True(te.e.t, r.OK, r.Error)
	return r
}

func (te *testEngine) register() {
	te.e.t.Helper()
	reply := te.request("register", te.spec)
	require.Contains(te.e.t, string(reply), `"ok":true`, "register reply")
	var r messages.RegisterReply
	require.NoError(te.e.t, json.Unmarshal(reply, &r))
	require.Equal(te.e.t, messages.RegisterReply{OK: true, Node: te.e.node.NodeID(), Boot: te.e.node.Boot(),
		LeaseMS: r.LeaseMS}, r)
	require.Positive(te.e.t, r.LeaseMS)
	if !te.registered {
		te.registered = true
		kv := recv(te.e.t, te.kv, "AllBlocksCleared")
		require.Len(te.e.t, kv.Events, 1)
		require.Equal(te.e.t, messages.KVAllBlocksCleared, kv.Events[0].Type)
		require.Equal(te.e.t, messages.MediumCPU, kv.Events[0].Medium)
	}
}

func (te *testEngine) request(verb string, body any) []byte {
	te.e.t.Helper()
	data, err := json.Marshal(body)
	require.NoError(te.e.t, err)
	msg, err := testkit.EngineRequest(te.e.nc, te.id, "kvactors."+te.id+"."+verb, data, 5*time.Second)
	require.NoError(te.e.t, err, verb)
	return msg.Data
}

// block returns the bytes of GPU block b of group g.
func (te *testEngine) block(g int, b messages.BlockID) []byte {
	off := te.spec.Groups[g].Regions[0].Offset + int64(b)*te.blockLen
	return te.seg.Bytes()[off : off+te.blockLen]
}

// fill writes a pattern into block b of group g.
func (te *testEngine) fill(g int, b messages.BlockID, gen byte) {
	p := te.block(g, b)
	for i := range p {
		p[i] = byte(int(gen)*31 + g*7 + int(b)*13 + i)
	}
}

// oneChunkReady fills block 1 of group 0 and makes request req's one chunk
// (4 tokens in block 1, defaultOpts' layout) ready to store.
func (te *testEngine) oneChunkReady(req string) {
	te.e.t.Helper()
	te.fill(0, 1, 1)
	te.send(added(req, 4), hashesEv(req, 0, hash(req, 0)), blocksEv(req, 0, 0, 1), tokensEv(req, 4, 4))
}

// send publishes one batch of wire events (maps, so tests can send anything).
func (te *testEngine) send(events ...map[string]any) {
	te.e.t.Helper()
	te.seq++
	te.sendRaw(map[string]any{"epoch": te.epoch, "seq": te.seq, "events": events})
}

func (te *testEngine) sendRaw(body any) {
	te.e.t.Helper()
	data, ok := body.([]byte)
	if !ok {
		var err error
		data, err = json.Marshal(body)
		require.NoError(te.e.t, err)
	}
	require.NoError(te.e.t, te.e.nc.Publish("kvactors."+te.id+".events", data))
	require.NoError(te.e.t, te.e.nc.Flush())
}

func added(req string, prompt int) map[string]any {
	return map[string]any{"type": "added", "request": req, "prompt_tokens": prompt}
}

func hashesEv(req string, start int, hs ...string) map[string]any {
	return map[string]any{"type": "hashes", "request": req, "start": start, "hashes": hs}
}

func blocksEv(req string, group, start int, ids ...int) map[string]any {
	return map[string]any{"type": "blocks", "request": req, "group": group, "start": start, "ids": ids}
}

func tokensEv(req string, computed, total int) map[string]any {
	return map[string]any{"type": "tokens", "request": req, "computed": computed, "total": total}
}

func finishedEv(req string, aborted bool, computed, total int) map[string]any {
	return map[string]any{"type": "finished", "request": req, "aborted": aborted, "computed": computed, "total": total}
}

// hash is a deterministic 8-byte hash for block i of a prompt family.
func hash(family string, i int) string {
	return hex.EncodeToString([]byte(fmt.Sprintf("%-4.4s%04d", family, i)))
}

func recv[T any](t *testing.T, ch <-chan T, what string) T {
	t.Helper()
	select {
	case v := <-ch:
		return v
	case <-time.After(5 * time.Second):
		t.Fatalf("timed out waiting for %s", what)
	}
	var zero T
	return zero
}

// none asserts nothing arrives on ch until a status round trip proves the
// node has processed everything sent before (status goes through the same
// engine actor after the batches). A stored message could still follow a
// copy in flight, so none also requires that no request has a job in flight:
// otherwise a late duplicate store would slip past it.
func none[T any](te *testEngine, ch <-chan T, what string) {
	te.e.t.Helper()
	st := te.sync()
	for _, r := range st.Requests {
		require.Empty(te.e.t, r.InFlight, "request %s still has store jobs in flight", r.Request)
	}
	// What the node published before the status reply came off the
	// connection before it, in order: let the subscriptions' own
	// goroutines finish with it before looking.
	testkit.Eventually(te.e.t, 5*time.Second, time.Millisecond, func() error {
		for _, w := range te.subs {
			if err := w.settled(); err != nil {
				return err
			}
		}
		return nil
	})
	select {
	case v := <-ch:
		te.e.t.Fatalf("unexpected %s: %+v", what, v)
	default:
	}
}

// sync waits until the engine actor and its request actors have handled
// everything published before: a status query is answered after them.
func (te *testEngine) sync() node.StatusReply {
	te.e.t.Helper()
	require.NoError(te.e.t, te.e.nc.Flush())
	var st node.StatusReply
	require.NoError(te.e.t, json.Unmarshal(te.request("status", map[string]any{}), &st))
	require.Empty(te.e.t, st.Error)
	return st
}

func jsonUnmarshal(data []byte, v any) error { return json.Unmarshal(data, v) }

func errf(format string, a ...any) error { return fmt.Errorf(format, a...) }
