package node_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/actors/transfer"
	"github.com/kvactors/kvactors/backend"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/node"
)

// dirGate holds, while hold is set, every load copy until loadGo lets one
// go and every store copy until storeGo does; it tells of each held copy
// on loads or stores.
type dirGate struct {
	hold            atomic.Bool
	loads, stores   chan struct{}
	loadGo, storeGo chan struct{}
}

type dirGated struct {
	backend.Attachment
	g *dirGate
}

func (g *dirGate) wrap(a backend.Attachment) backend.Attachment { return &dirGated{a, g} }

func (d *dirGated) Copy(dir backend.Direction, a backend.Arena, r []backend.Range) error {
	if d.g.hold.Load() {
		if dir == backend.HostToDevice {
			d.g.loads <- struct{}{}
			<-d.g.loadGo
		} else {
			d.g.stores <- struct{}{}
			<-d.g.storeGo
		}
	}
	return d.Attachment.Copy(dir, a, r)
}

// PROTOCOL.md "kv_events", reconnect: kv_events the node publishes while
// its NATS connection is down are lost past the client's reconnect buffer
// (here none, the fault injected: it stands for a full buffer, or bytes
// written into the connection that died), and the node cannot tell which.
// A router that followed the node must still end believing what the pool
// holds once the node is back. The node's link is cut while a load pins
// chunk a in a two-chunk pool, b's store fills the other slot and c's
// store waits for room; the load ends during the outage, so c's store
// evicts a then (its BlockRemoved lost), and b and c become ready (their
// BlockStored lost). Without the node's re-announcement after the
// reconnect the router believes a held for good (a wasted load) and
// knows nothing of b and c.
func TestARouterFollowsThePoolAcrossANATSOutage(t *testing.T) { // not parallel: an outage bounded by the lease
	s := testkit.NATSServer(t)
	link := testkit.NewLink(t, strings.TrimPrefix(s.ClientURL(), "nats://"))
	gate := &dirGate{loads: make(chan struct{}, 4), stores: make(chan struct{}, 4),
		loadGo: make(chan struct{}, 4), storeGo: make(chan struct{}, 4)}
	reg := prometheus.NewRegistry()
	dir := t.TempDir()
	cfg := node.Config{NATSURL: "nats://" + link.Addr, ShmDir: dir, PoolBytes: 2 * 256, HTTPAddr: "off",
		Registry: reg, Log: slog.New(slog.NewTextHandler(io.Discard, nil)), WrapDevice: gate.wrap,
		Transfer: transfer.Config{Workers: 4}, // the load, b's and c's copies at once
		FailStop: func(reason string) { t.Errorf("the node fail-stopped: %s", reason) }}
	node.WithNATSOptions(nats.ReconnectBufSize(-1))(&cfg) // what it publishes while cut off is lost
	n, err := node.Start(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(func() { _ = n.Close(context.Background()) })
	t.Cleanup(func() { // before the node's Close (LIFO): a copy still held would keep it waiting
		gate.hold.Store(false)
		close(gate.loadGo)
		close(gate.storeGo)
	})
	e := &env{t: t, node: n, reg: reg, dir: dir, nc: testkit.Connect(t, s)} // not through the link
	router := newKVRouter(t, e.nc)
	te := e.newEngine("e1", defaultOpts())
	te.register()

	ha, hb, hc := hash("outa", 0), hash("outb", 0), hash("outc", 0)
	te.send(added("a", 4), hashesEv("a", 0, ha), blocksEv("a", 0, 0, 1), tokensEv("a", 4, 4))
	recv(t, te.stored, "a stored")
	believes := func(h string) bool {
		router.mu.Lock()
		defer router.mu.Unlock()
		return router.cpu[h]
	}
	testkit.Eventually(t, 5*time.Second, 5*time.Millisecond, func() error {
		if !believes(ha) {
			return errors.New("the router has not heard of a")
		}
		return nil
	})

	gate.hold.Store(true)
	_ = te.loadAsync("la", []string{ha}, 4, []int{10}) // its reply is lost in the outage
	testkit.Recv(t, gate.loads, 5*time.Second, "the load of a to pin it")
	te.send(added("b", 4), hashesEv("b", 0, hb), blocksEv("b", 0, 0, 2), tokensEv("b", 4, 4))
	testkit.Recv(t, gate.stores, 5*time.Second, "b's store copy in the pool's other slot")
	te.send(added("c", 4), hashesEv("c", 0, hc), blocksEv("c", 0, 0, 3), tokensEv("c", 4, 4))
	te.sync() // c's store was decided: no room (a pinned, b pending), a retry waits for room

	reconnects := e.counter("kvactors_nats_events_total", "reconnect")
	cut := time.Now()
	link.Cut()
	testkit.Eventually(t, 5*time.Second, 5*time.Millisecond, func() error {
		if e.counter("kvactors_nats_events_total", "disconnect") == 0 {
			return errors.New("the node has not seen its connection drop")
		}
		return nil
	})
	gate.loadGo <- struct{}{} // a unpinned: c's retry evicts it
	testkit.Recv(t, gate.stores, 5*time.Second, "c's store copy, in the room a left")
	gate.storeGo <- struct{}{}
	gate.storeGo <- struct{}{}
	link.Restore()
	testkit.Eventually(t, 5*time.Second, 5*time.Millisecond, func() error {
		if e.counter("kvactors_nats_events_total", "reconnect") == reconnects {
			return errors.New("the node has not reconnected")
		}
		return nil
	})
	require.Less(t, time.Since(cut), 10*time.Second/2, "the outage outlasted half the lease: copies were fenced")

	testkit.Eventually(t, 5*time.Second, 20*time.Millisecond, func() error {
		for _, h := range []string{ha, hb, hc} {
			got, err := te.tryLookup([]string{h}, time.Second) // the node's subscriptions may still be coming back
			if err != nil {
				return err
			}
			if held := got > 0; believes(h) != held {
				return fmt.Errorf("the router believes %s held=%v, the pool says %v", h, believes(h), held)
			}
		}
		return nil
	})
	require.Zero(t, te.lookup([]string{ha}), "a was evicted for c")
}
