package node_test

import (
	"context"
	"io"
	"log/slog"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/backend"
	"github.com/kvactors/kvactors/internal/testkit"
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
