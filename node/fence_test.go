package node_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"path/filepath"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/backend"
	"github.com/kvactors/kvactors/backend/shm"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/node"
)

// heldDevice holds every copy until the test lets it go.
type heldDevice struct {
	backend.Attachment
	started chan struct{}
	gate    chan struct{}
	// fail, when set and true, fails each copy let through the gate
	// (errInjectedCopy) instead of copying.
	fail *atomic.Bool
}

// errInjectedCopy is a heldDevice's failed copy.
var errInjectedCopy = errors.New("injected copy failure")

// wrap is a WrapDevice: one held device per attachment, all sharing d's
// channels, so an engine reset (a second attachment) does not retarget the
// first one's Close at the second.
func (d *heldDevice) wrap(a backend.Attachment) backend.Attachment {
	return &heldDevice{Attachment: a, started: d.started, gate: d.gate, fail: d.fail}
}

func (d *heldDevice) Copy(dir backend.Direction, a backend.Arena, r []backend.Range) error {
	d.started <- struct{}{}
	<-d.gate
	if d.fail != nil && d.fail.Load() {
		return errInjectedCopy
	}
	return d.Attachment.Copy(dir, a, r)
}

// PROTOCOL.md "Fencing, node side": a copy still running 5/8 lease after
// the node's last round trip with NATS ends the process (fail-stop), so it
// cannot write after the engine may have declared the node lost. The outage
// is injected by stopping the NATS server the node uses.
func TestCopyRunningThroughAnOutageFailStops(t *testing.T) { // not parallel: a 400 ms lease's fail-stop window
	const lease = 400 * time.Millisecond
	s, err := server.NewServer(&server.Options{Host: "127.0.0.1", Port: server.RANDOM_PORT, NoLog: true, NoSigs: true})
	require.NoError(t, err)
	s.Start()
	require.True(t, s.ReadyForConnections(10*time.Second))
	t.Cleanup(s.Shutdown)
	dev := &heldDevice{started: make(chan struct{}, 8), gate: make(chan struct{})}
	var stopped atomic.Int64 // when FailStop ran (unix nanos)
	stops := make(chan string, 1)
	reg := prometheus.NewRegistry()
	dir := t.TempDir()
	n, err := node.Start(context.Background(), node.Config{NATSURL: s.ClientURL(), ShmDir: dir, PoolBytes: 1 << 20,
		HTTPAddr: "off", Registry: reg, Lease: lease, Log: slog.New(slog.NewTextHandler(io.Discard, nil)),
		WrapDevice: func(d backend.Attachment) backend.Attachment { dev.Attachment = d; return dev },
		FailStop: func(reason string) {
			stopped.Store(time.Now().UnixNano())
			stops <- reason
		}})
	require.NoError(t, err)
	t.Cleanup(func() {
		close(dev.gate)
		_ = n.Close(context.Background())
	})
	e := &env{t: t, node: n, reg: reg, dir: dir}
	e.nc, err = nats.Connect(s.ClientURL())
	require.NoError(t, err)
	t.Cleanup(e.nc.Close)
	te := e.newEngine("e1", defaultOpts())
	te.register()
	te.send(added("r", 4), hashesEv("r", 0, hash("r", 0)), blocksEv("r", 0, 0, 1), tokensEv("r", 4, 4))
	testkit.Recv(t, dev.started, 5*time.Second, "the store copy to start")
	testkit.NoRecv(t, stops, 2*lease, "a fail-stop while NATS answers")

	cut := time.Now()
	s.Shutdown()
	reason := testkit.Recv(t, stops, 10*time.Second, "the fail-stop")
	require.Contains(t, reason, "lease")
	// 5/8 lease after the last round trip, which was sent before the cut (every
	// lease/8 when the pinger is not starved; a loaded machine delays it), so
	// after lease/4 from the cut at least, and not much later than 3/4 lease (the
	// watchdog looks every lease/8).
	after := time.Duration(stopped.Load() - cut.UnixNano())
	require.GreaterOrEqual(t, after, lease/4, "fail-stop long before the round trips aged")
	require.Less(t, after, 3*lease)
	t.Logf("fail-stop %v after the outage began (lease %v)", after, lease)
}

// PROTOCOL.md "P.E.unregister": in-flight copies (a store and a load) finish
// before the segments are unmapped, and the reply comes only after that; a
// queued copy is cancelled. The copies are held in flight by the test.
func TestUnregisterWaitsForCopiesInFlight(t *testing.T) {
	t.Parallel()
	dev := &heldDevice{started: make(chan struct{}, 8), gate: make(chan struct{})}
	e := startNode(t, func(c *node.Config) {
		c.WrapDevice = func(d backend.Attachment) backend.Attachment { dev.Attachment = d; return dev }
		c.Transfer.Workers = 2
	})
	te := e.newEngine("e1", defaultOpts())
	te.register()
	path := filepath.Join(e.dir, te.spec.Segments[0].Shm)
	released := false
	t.Cleanup(func() {
		if !released {
			close(dev.gate)
		}
	})
	// A stored chunk to load later: let its copy through.
	te.send(added("a", 4), hashesEv("a", 0, hash("a", 0)), blocksEv("a", 0, 0, 1), tokensEv("a", 4, 4))
	testkit.Recv(t, dev.started, 5*time.Second, "store copy of a")
	dev.gate <- struct{}{}
	recv(t, te.stored, "stored a")

	// Now hold a store (b) and a load in flight, and queue a third copy (c).
	te.send(added("b", 4), hashesEv("b", 0, hash("b", 0)), blocksEv("b", 0, 0, 2), tokensEv("b", 4, 4))
	testkit.Recv(t, dev.started, 5*time.Second, "store copy of b")
	loadReply := make(chan *nats.Msg, 1)
	body, _ := json.Marshal(map[string]any{"request": "l", "hashes": []string{hash("a", 0)}, "num_tokens": 4,
		"blocks": [][]int{{9}}})
	_, err := e.nc.ChanSubscribe("_INBOX.e1.load", loadReply)
	require.NoError(t, err)
	require.NoError(t, e.nc.PublishRequest("kvactors.e1.load", "_INBOX.e1.load", body))
	testkit.Recv(t, dev.started, 5*time.Second, "load copy")
	te.send(added("c", 4), hashesEv("c", 0, hash("c", 0)), blocksEv("c", 0, 0, 3), tokensEv("c", 4, 4))
	te.sync() // c's job is queued behind the two held workers

	unreg := make(chan *nats.Msg, 1)
	_, err = e.nc.ChanSubscribe("_INBOX.e1.unreg", unreg)
	require.NoError(t, err)
	require.NoError(t, e.nc.PublishRequest("kvactors.e1.unregister", "_INBOX.e1.unreg", []byte(`{}`)))
	testkit.NoRecv(t, unreg, 100*time.Millisecond, "the unregister reply while copies are in flight")
	require.True(t, mapped(t, path), "segments unmapped under a running copy")
	// c's queued copy is cancelled, never run: the queue empties while both
	// workers are still held.
	testkit.Eventually(t, 5*time.Second, time.Millisecond, func() error {
		if q := metricValue(t, e.reg, "kvactors_transfer_jobs_queued", nil); q != 0 {
			return fmt.Errorf("%v copies still queued", q)
		}
		return nil
	})

	released = true
	close(dev.gate)
	require.Contains(t, string(testkit.Recv(t, loadReply, 5*time.Second, "load reply").Data), `"ok":true`)
	var r messages.UnregisterReply
	require.NoError(t, json.Unmarshal(testkit.Recv(t, unreg, 5*time.Second, "unregister reply").Data, &r))
	require.True(t, r.OK, r.Error)
	require.Equal(t, 3, r.Released)
	require.False(t, mapped(t, path))
	got := map[string]string{}
	for range 3 {
		rel := recv(t, te.released, "release")
		got[rel.Request] = rel.Reason
	}
	require.Equal(t, map[string]string{"a": "engine_gone", "b": "engine_gone", "c": "engine_gone"}, got)
	require.Empty(t, dev.started, "the queued copy ran")
}

// PROTOCOL.md "Fencing, node side": during a NATS outage, once no round trip
// has completed for lease/2, no copy starts; the waiting copy is not dropped
// at the fence, and no fail-stop or lapse comes of it. The outage is
// injected by stopping the server; one copy worker, held by a first copy,
// makes the second wait in the queue. The outage stays well under 3/4 lease
// (a lapse, which refuses the copy: TestLapseRefusesTheOldSessionsCopies):
// fenced by lease/2 after the last round trip, back about a reconnect
// (~0.35 s) later, 1.5 s short of it. The engine, cut off too, was silent at
// the node for lease/2 by then ("Engine silence"; the fence counts from a
// round trip made after the engine's last message): the copy, let through by
// the fence, is refused as its engine's, and when the engine is heard again
// its requests are reset (an SDK engine resyncs after its own reconnect
// anyway); the copy never runs.
func TestCopiesWaitThroughAnOutage(t *testing.T) { // not parallel: restarts a NATS server on the port it freed
	const lease = 8 * time.Second
	port := freePort(t)
	start := func() *server.Server {
		s, err := server.NewServer(&server.Options{Host: "127.0.0.1", Port: port, NoLog: true, NoSigs: true})
		require.NoError(t, err)
		s.Start()
		require.True(t, s.ReadyForConnections(10*time.Second))
		return s
	}
	s := start()
	dev := &heldDevice{started: make(chan struct{}, 8), gate: make(chan struct{}, 8)}
	stops := make(chan string, 1)
	reg := prometheus.NewRegistry()
	dir := t.TempDir()
	cfg := node.Config{NATSURL: s.ClientURL(), ShmDir: dir, PoolBytes: 1 << 20, HTTPAddr: "off", Registry: reg,
		Lease: lease, Log: slog.New(slog.NewTextHandler(io.Discard, nil)),
		WrapDevice: func(d backend.Attachment) backend.Attachment { dev.Attachment = d; return dev },
		FailStop:   func(reason string) { stops <- reason }}
	cfg.Transfer.Workers = 1
	n, err := node.Start(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(func() { close(dev.gate); _ = n.Close(context.Background()) })
	e := &env{t: t, node: n, reg: reg, dir: dir}
	e.nc, err = nats.Connect(s.ClientURL(), nats.MaxReconnects(-1), nats.ReconnectWait(20*time.Millisecond))
	require.NoError(t, err)
	t.Cleanup(e.nc.Close)
	te := e.newEngine("e1", defaultOpts())
	te.register()
	heldAndQueued(t, te, dev)
	// A round trip sent after the engine's last message, so the fence
	// counts from no earlier than the engine's silence: wherever the
	// fence lifts, the engine has been silent for lease/2. Without it the
	// last round trip could be up to the pinger's period (lease/8) older,
	// and a reconnect quicker than that let b's copy start (seen once in a
	// dozen runs under load).
	require.NoError(t, n.Ping())

	s.Shutdown()
	awaitFenced(t, n, lease)
	require.ErrorContains(t, n.Ready(), "not connected")
	dev.gate <- struct{}{} // a ends (before the lease runs out): the worker takes b, which must wait
	testkit.Eventually(t, 5*time.Second, time.Millisecond, func() error {
		if v := metricValue(t, reg, "kvactors_transfer_fence_waits_total", nil); v < 1 {
			return fmt.Errorf("b's copy has not reached the fence")
		}
		return nil
	})
	testkit.NoRecv(t, dev.started, 50*time.Millisecond, "copy b starting while fenced")

	s = start()
	t.Cleanup(s.Shutdown)
	t.Cleanup(func() { _ = n.Close(context.Background()) }) // before the server goes
	// This client must be back (and resubscribed) before b's stored goes out.
	testkit.Eventually(t, 10*time.Second, time.Millisecond, func() error {
		if !e.nc.IsConnected() {
			return fmt.Errorf("test client not reconnected")
		}
		return e.nc.Flush()
	})
	testkit.Eventually(t, 10*time.Second, time.Millisecond, func() error {
		if v := metricValue(t, reg, "kvactors_transfer_copies_engine_silent_total", nil); v < 1 {
			return fmt.Errorf("b's copy, past the fence, not refused as its silent engine's yet (fenced %v, lapses %v, copies started %d)",
				n.Fenced(), metricValue(t, reg, "kvactors_transfer_fence_lapses_total", nil), len(dev.started))
		}
		return nil
	})
	require.False(t, n.Fenced())
	require.Zero(t, metricValue(t, reg, "kvactors_transfer_fence_lapses_total", nil), "the outage lapsed")
	// The engine is heard again (its heartbeat, once the node has
	// resubscribed): its requests are reset, b never copies.
	testkit.Eventually(t, 10*time.Second, 10*time.Millisecond, func() error {
		_, err := testkit.EngineRequest(e.nc, "e1", "kvactors.e1.heartbeat", []byte(`{"epoch":"ep1","seq":2}`), time.Second)
		return err
	})
	for {
		rel := recv(t, te.released, "b's release")
		require.Equal(t, messages.ReasonEngineReset, rel.Reason)
		if rel.Request == "b" {
			break
		}
	}
	testkit.NoRecv(t, dev.started, 100*time.Millisecond, "copy b after its engine's reset")
	testkit.NoRecv(t, stops, 10*time.Millisecond, "a fail-stop (no copy ran through the lease)")
}

// A load copying into the engine's blocks is not a request of the engine,
// yet unregister still waits for it before unmapping the segments.
func TestUnregisterWaitsForALoadInFlight(t *testing.T) {
	t.Parallel()
	dev := &heldDevice{started: make(chan struct{}, 8), gate: make(chan struct{}, 8)}
	e := startNode(t, func(c *node.Config) {
		c.WrapDevice = func(d backend.Attachment) backend.Attachment { dev.Attachment = d; return dev }
	})
	te := e.newEngine("e1", defaultOpts())
	te.register()
	path := filepath.Join(e.dir, te.spec.Segments[0].Shm)
	te.send(added("a", 4), hashesEv("a", 0, hash("a", 0)), blocksEv("a", 0, 0, 1), tokensEv("a", 4, 4),
		finishedEv("a", false, 4, 4))
	testkit.Recv(t, dev.started, 5*time.Second, "store copy of a")
	dev.gate <- struct{}{}
	recv(t, te.stored, "stored a")
	recv(t, te.released, "a released") // no request is left

	loadReply := make(chan *nats.Msg, 1)
	_, err := e.nc.ChanSubscribe("_INBOX.e1.load2", loadReply)
	require.NoError(t, err)
	body, _ := json.Marshal(map[string]any{"request": "l", "hashes": []string{hash("a", 0)}, "num_tokens": 4,
		"blocks": [][]int{{9}}})
	require.NoError(t, e.nc.PublishRequest("kvactors.e1.load", "_INBOX.e1.load2", body))
	testkit.Recv(t, dev.started, 5*time.Second, "load copy")
	unreg := make(chan *nats.Msg, 1)
	_, err = e.nc.ChanSubscribe("_INBOX.e1.unreg2", unreg)
	require.NoError(t, err)
	require.NoError(t, e.nc.PublishRequest("kvactors.e1.unregister", "_INBOX.e1.unreg2", []byte(`{}`)))
	testkit.NoRecv(t, unreg, 100*time.Millisecond, "the unregister reply while a load copies")
	require.True(t, mapped(t, path), "segments unmapped under a running load")
	dev.gate <- struct{}{}
	require.Contains(t, string(testkit.Recv(t, loadReply, 5*time.Second, "load reply").Data), `"ok":true`)
	var r messages.UnregisterReply
	require.NoError(t, json.Unmarshal(testkit.Recv(t, unreg, 5*time.Second, "unregister reply").Data, &r))
	require.Equal(t, 0, r.Released)
	require.False(t, mapped(t, path))
}

// heldAndQueued stores a, whose copy dev holds, and b, whose copy is queued
// behind it (the node runs one copy worker).
func heldAndQueued(t *testing.T, te *testEngine, dev *heldDevice) {
	t.Helper()
	te.send(added("a", 4), hashesEv("a", 0, hash("a", 0)), blocksEv("a", 0, 0, 1), tokensEv("a", 4, 4))
	testkit.Recv(t, dev.started, 5*time.Second, "copy a")
	te.send(added("b", 4), hashesEv("b", 0, hash("b", 0)), blocksEv("b", 0, 0, 2), tokensEv("b", 4, 4))
	te.sync() // b's copy is queued behind a's
}

// awaitFenced waits until the node holds its copies back (no NATS round
// trip for lease/2).
func awaitFenced(t *testing.T, n *node.Node, within time.Duration) {
	t.Helper()
	testkit.Eventually(t, within, time.Millisecond, func() error {
		if !n.Fenced() {
			return fmt.Errorf("not fenced yet")
		}
		return nil
	})
}

// A load copying into an engine's blocks when the engine registers again
// with another spec (an engine reset: the old engine actor is retired) keeps
// the old segments mapped until it is done, as an unregister does
// (TestUnregisterWaitsForALoadInFlight): the retire waits on the old
// record's load gate before it unmaps them.
func TestARespecWaitsForALoadInFlightBeforeUnmapping(t *testing.T) {
	t.Parallel()
	started, gate := make(chan struct{}, 8), make(chan struct{}, 8)
	e := startNode(t, func(c *node.Config) {
		c.WrapDevice = func(d backend.Attachment) backend.Attachment {
			return &heldDevice{Attachment: d, started: started, gate: gate} // one per attach: old and new
		}
	})
	t.Cleanup(func() { close(gate) }) // before the node's Close: no copy left held
	te := e.newEngine("e1", defaultOpts())
	te.register()
	oldPath := filepath.Join(e.dir, te.spec.Segments[0].Shm)
	te.send(added("a", 4), hashesEv("a", 0, hash("a", 0)), blocksEv("a", 0, 0, 1), tokensEv("a", 4, 4),
		finishedEv("a", false, 4, 4))
	testkit.Recv(t, started, 5*time.Second, "store copy of a")
	gate <- struct{}{}
	recv(t, te.stored, "stored a")
	recv(t, te.released, "a released")

	loadReply := make(chan *nats.Msg, 1)
	inbox := testkit.EngineInbox("e1")
	_, err := e.nc.ChanSubscribe(inbox, loadReply)
	require.NoError(t, err)
	body, _ := json.Marshal(map[string]any{"request": "l", "hashes": []string{hash("a", 0)}, "num_tokens": 4,
		"blocks": [][]int{{9}}})
	require.NoError(t, e.nc.PublishRequest("kvactors.e1.load", inbox, body))
	testkit.Recv(t, started, 5*time.Second, "load copy")

	seg2, err := shm.Create(e.dir, "e1-seg2", int64(len(te.seg.Bytes())))
	require.NoError(t, err)
	t.Cleanup(func() { _ = seg2.Remove() })
	spec := te.spec
	spec.Segments = []messages.Segment{{Shm: seg2.Name()}}
	require.Contains(t, string(te.request("register", spec)), `"ok":true`)
	// The old engine actor has stopped (its record's end begins then).
	testkit.Eventually(t, 5*time.Second, time.Millisecond, func() error {
		if v := metricValue(t, e.reg, "kvactors_engine_live", nil); v != 1 {
			return fmt.Errorf("%v engine actors live", v)
		}
		return nil
	})
	testkit.NoRecv(t, loadReply, 100*time.Millisecond, "the load's reply while it copies")
	require.True(t, mapped(t, oldPath), "the old segments unmapped under a running load")

	gate <- struct{}{}
	require.Contains(t, string(testkit.Recv(t, loadReply, 5*time.Second, "load reply").Data), `"ok":true`)
	testkit.Eventually(t, 5*time.Second, time.Millisecond, func() error {
		if mapped(t, oldPath) {
			return fmt.Errorf("the old segments are still mapped")
		}
		return nil
	})
}
