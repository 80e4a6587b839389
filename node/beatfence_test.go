package node_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/backend"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/node"
)

// stampDevice records when each copy starts.
type stampDevice struct {
	backend.Attachment
	mu    sync.Mutex
	times []time.Time
}

func (d *stampDevice) Copy(dir backend.Direction, a backend.Arena, r []backend.Range) error {
	d.mu.Lock()
	d.times = append(d.times, time.Now())
	d.mu.Unlock()
	return d.Attachment.Copy(dir, a, r)
}

// Engines judge the node by its heartbeats, the fence by round trips with
// NATS. The heartbeat went out from a loop that first took the node's
// lock, the pinger took none: a register holding the lock (a slow backend
// attach: here its WrapDevice, called under it, waits for the test)
// stopped the heartbeats while round trips went on, and another engine's
// copies kept starting more than a lease after the node's last heartbeat,
// when that engine may have declared the node lost and reused its blocks.
func TestAStalledRegisterStopsNeitherHeartbeatsNorTheFence(t *testing.T) { // not parallel: a 400 ms lease's windows
	const lease = 400 * time.Millisecond
	s := testkit.NATSServer(t)
	var busy, slow string // on the two intake shards
	for i := 0; busy == "" || slow == ""; i++ {
		id := fmt.Sprintf("e%d", i)
		switch {
		case node.ShardOf(id, 2) == 0 && busy == "":
			busy = id
		case node.ShardOf(id, 2) == 1 && slow == "":
			slow = id
		}
	}
	dev := &stampDevice{}
	attaching, attach := make(chan struct{}, 1), make(chan struct{})
	var wraps sync.Mutex
	wrapped := 0
	reg := prometheus.NewRegistry()
	dir := t.TempDir()
	n, err := node.Start(context.Background(), node.Config{NATSURL: s.ClientURL(), ShmDir: dir, PoolBytes: 4 << 20,
		HTTPAddr: "off", Registry: reg, Lease: lease, Log: slog.New(slog.NewTextHandler(io.Discard, nil)), DecodeWorkers: 2,
		WrapDevice: func(d backend.Attachment) backend.Attachment {
			wraps.Lock()
			wrapped++
			first := wrapped == 1
			wraps.Unlock()
			if first {
				dev.Attachment = d
				return dev
			}
			attaching <- struct{}{}
			<-attach // a slow attach, under the node's lock
			return d
		},
		FailStop: func(reason string) { t.Errorf("fail-stop: %s", reason) }})
	require.NoError(t, err)
	t.Cleanup(func() { _ = n.Close(context.Background()) })
	e := &env{t: t, node: n, reg: reg, dir: dir, nc: testkit.Connect(t, s)}
	var bmu sync.Mutex
	var beats []time.Time
	_, err = e.nc.Subscribe("kvactors._node.>", func(m *nats.Msg) {
		if strings.HasSuffix(m.Subject, ".heartbeat") {
			bmu.Lock()
			beats = append(beats, time.Now())
			bmu.Unlock()
		}
	})
	require.NoError(t, err)
	te := e.newEngine(busy, defaultOpts())
	te.register()
	slowEngine := e.newEngine(slow, defaultOpts())
	go func() {
		data, _ := json.Marshal(slowEngine.spec)
		_, _ = testkit.EngineRequest(e.nc, slow, "kvactors."+slow+".register", data, 10*lease)
	}()
	testkit.Recv(t, attaching, 5*time.Second, "the slow register's attach")
	start := time.Now()
	for i := 0; time.Since(start) < 4*lease; i++ { // a busy engine: batches, no heartbeats of its own needed
		r := fmt.Sprintf("r%d", i)
		te.send(added(r, 4), hashesEv(r, 0, hash(r, i)), blocksEv(r, 0, 0, i%64), tokensEv(r, 4, 4))
		time.Sleep(lease / 8) // the engine's pace, not a wait for the node
	}
	close(attach)
	bmu.Lock()
	bs := append([]time.Time(nil), beats...)
	bmu.Unlock()
	dev.mu.Lock()
	copies := append([]time.Time(nil), dev.times...)
	dev.mu.Unlock()
	require.NotEmpty(t, copies)
	for _, c := range copies {
		last := time.Time{}
		for _, b := range bs {
			if b.Before(c) {
				last = b
			}
		}
		require.False(t, last.IsZero(), "a copy before any heartbeat")
		require.Less(t, c.Sub(last), 3*lease/4, "a copy started %v after the node's last heartbeat (lease %v)", c.Sub(last), lease)
	}
}
