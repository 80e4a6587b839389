package node_test

import (
	"context"
	"encoding/json"
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
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/node"
)

// heldDevice holds every copy until the test lets it go.
type heldDevice struct {
	backend.Device
	started chan struct{}
	gate    chan struct{}
}

func (d *heldDevice) Copy(dir backend.Direction, a backend.Arena, r []backend.Range) error {
	d.started <- struct{}{}
	<-d.gate
	return d.Device.Copy(dir, a, r)
}

// PROTOCOL.md "Fencing, node side": a copy still running lease after the
// node's last round trip with NATS ends the process (fail-stop), so it
// cannot write after the engine may have declared the node lost. The outage
// is injected by stopping the NATS server the node uses.
func TestCopyRunningThroughAnOutageFailStops(t *testing.T) {
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
		WrapDevice: func(d backend.Device) backend.Device { dev.Device = d; return dev },
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
	// Not before a lease since the outage's last possible round trip, and
	// not much later (the watchdog looks every lease/8).
	after := time.Duration(stopped.Load() - cut.UnixNano())
	require.GreaterOrEqual(t, after, lease-lease/4, "fail-stop before the lease ran out")
	require.Less(t, after, 3*lease)
}

// PROTOCOL.md "P.E.unregister": in-flight copies (a store and a load) finish
// before the segments are unmapped, and the reply comes only after that; a
// queued copy is cancelled. The copies are held in flight by the test.
func TestUnregisterWaitsForCopiesInFlight(t *testing.T) {
	dev := &heldDevice{started: make(chan struct{}, 8), gate: make(chan struct{})}
	e := startNode(t, func(c *node.Config) {
		c.WrapDevice = func(d backend.Device) backend.Device { dev.Device = d; return dev }
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
	_, err := e.nc.ChanSubscribe("_INBOX.load", loadReply)
	require.NoError(t, err)
	require.NoError(t, e.nc.PublishRequest("kvactors.e1.load", "_INBOX.load", body))
	testkit.Recv(t, dev.started, 5*time.Second, "load copy")
	te.send(added("c", 4), hashesEv("c", 0, hash("c", 0)), blocksEv("c", 0, 0, 3), tokensEv("c", 4, 4))
	te.sync() // c's job is queued behind the two held workers

	unreg := make(chan *nats.Msg, 1)
	_, err = e.nc.ChanSubscribe("_INBOX.unreg", unreg)
	require.NoError(t, err)
	require.NoError(t, e.nc.PublishRequest("kvactors.e1.unregister", "_INBOX.unreg", []byte(`{}`)))
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
