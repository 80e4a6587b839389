package node_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/node"
)

// PROTOCOL.md "Fencing, node side", lapse: the node's NATS link is down for
// more than 3/4 lease, so an engine may have declared the node lost and
// reused the blocks of its requests. A store copy queued behind a held one
// (one worker) must never start, not even once NATS answers again; the
// engine is resynced (reason reconnect) and its old-epoch requests are
// released with engine_reset; the refusal is counted; a new epoch (after a
// re-register, in case the engine also expired) stores normally.
func TestLapseRefusesTheOldSessionsCopies(t *testing.T) { // not parallel: a lease-timed outage on a port it frees
	// Lease 4s: the lapse is seen by 7/8 lease after the last round trip
	// (watchdog every lease/8), before the engine, silent since the cut, may
	// expire (a lease after its last batch), which would release its
	// requests as engine_gone instead.
	const lease = 4 * time.Second
	s := testkit.NATSServer(t)
	l := testkit.NewLink(t, s.Addr().String())
	dev := &heldDevice{started: make(chan struct{}, 8), gate: make(chan struct{}, 8)}
	stops := make(chan string, 1)
	reg := prometheus.NewRegistry()
	dir := t.TempDir()
	cfg := node.Config{NATSURL: "nats://" + l.Addr, ShmDir: dir, PoolBytes: 1 << 20, HTTPAddr: "off", Registry: reg,
		Lease: lease, Log: slog.New(slog.NewTextHandler(io.Discard, nil)),
		WrapDevice: dev.wrap, // the re-register below, after the silence, is an engine reset
		FailStop:   func(reason string) { stops <- reason }}
	cfg.Transfer.Workers = 1
	n, err := node.Start(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(func() { close(dev.gate); _ = n.Close(context.Background()) })
	e := &env{t: t, node: n, reg: reg, dir: dir, nc: testkit.Connect(t, s)}
	counter := func(name string) float64 { return metricValue(t, reg, name, nil) }
	te := e.newEngine("e1", defaultOpts())
	te.register()
	heldAndQueued(t, te, dev)

	l.Cut()
	awaitFenced(t, n, lease)
	dev.gate <- struct{}{} // a ends long before the lease runs out; b reaches the fence
	testkit.Eventually(t, 2*lease, 5*time.Millisecond, func() error {
		if v := counter("kvactors_transfer_fence_lapses_total"); v != 1 {
			return fmt.Errorf("%v lapses recorded, want 1", v)
		}
		if v := counter("kvactors_transfer_copies_lapsed_total"); v < 1 {
			return errors.New("b's copy not refused yet")
		}
		return nil
	})

	l.Restore()
	testkit.Eventually(t, 10*time.Second, 5*time.Millisecond, func() error {
		return n.Ready() // connected, and a round trip since: not fenced
	})
	// What the node published during the outage reaches the engine now: the
	// resync of the old epoch and the old epoch's releases.
	rs := recv(t, te.resync, "the resync of the old epoch")
	require.Equal(t, "ep1", rs.Epoch)
	require.Equal(t, messages.ResyncReconnect, rs.Reason)
	got := map[string]string{}
	for range 2 {
		rel := recv(t, te.released, "an old-epoch release")
		got[rel.Request] = rel.Reason
	}
	require.Equal(t, map[string]string{"a": messages.ReasonEngineReset, "b": messages.ReasonEngineReset}, got)
	// The old session's copy never started, NATS back or not.
	te.register() // after a silence of lease/2: an engine reset (the engine may have freed its blocks)
	te.sync()
	testkit.NoRecv(t, dev.started, 100*time.Millisecond, "b's copy starting after the lapse")
	require.Equal(t, 1.0, counter("kvactors_transfer_fence_lapses_total"))
	require.Zero(t, counter("kvactors_transfer_failures_total"), "a refusal counted as a copy failure")

	// The engine's new epoch stores normally.
	te.epoch, te.seq = "ep2", 0
	te.send(added("c", 4), hashesEv("c", 0, hash("c", 0)), blocksEv("c", 0, 0, 3), tokensEv("c", 4, 4))
	testkit.Recv(t, dev.started, 5*time.Second, "copy c of the new epoch")
	dev.gate <- struct{}{}
	st := recv(t, te.stored, "stored after the lapse")
	if st.Request == "a" { // a's copy completed during the outage
		st = recv(t, te.stored, "stored c")
	}
	require.Equal(t, "c", st.Request)
	require.Equal(t, "ep2", te.sync().Epoch)
	testkit.NoRecv(t, stops, 10*time.Millisecond, "a fail-stop")
}

// PROTOCOL.md "Lapse", engine side, through the node's wiring of the
// fence's hooks: when a lapse is recorded every engine actor is told at
// once (its requests reset, engine_reset, its resync order held back), and
// when the round trip that ends it completes each is told again and sends
// the order it held. The lease is an hour, so no session tick (every
// lease/4), which would also show an engine actor the fence's move, lands
// in the test: only the lapse hooks can reach the actor. NATS stays up
// (the lapse is recorded as the watchdog would, RecordLapse), so what the
// actor publishes arrives at once.
func TestEnginesAreToldAtALapsesStartAndEnd(t *testing.T) {
	t.Parallel()
	e := startNode(t, func(c *node.Config) { c.Lease = time.Hour })
	te := e.newEngine("e1", defaultOpts())
	te.register()
	te.send(added("a", 4), blocksEv("a", 0, 0, 1)) // blocks, no tokens: nothing to copy, a release owed at a reset
	require.Len(t, te.sync().Requests, 1, "a is live")

	e.node.RecordLapse()
	require.Equal(t, 1.0, metricValue(t, e.reg, "kvactors_transfer_fence_lapses_total", nil))
	rel := recv(t, te.released, "a reset at the lapse's start")
	require.Equal(t, messages.Released{Request: "a", Reason: messages.ReasonEngineReset}, rel)
	// The order is held while the lapse lasts: sent now, it could reach the
	// engine ahead of the round trip that ends the lapse.
	none(te, te.resync, "a resync order during the lapse")

	require.NoError(t, e.node.Ping()) // the round trip that ends the lapse
	rs := recv(t, te.resync, "the held resync order at the lapse's end")
	require.Equal(t, "ep1", rs.Epoch)
	require.Equal(t, messages.ResyncReconnect, rs.Reason)
	require.Equal(t, e.node.Boot(), rs.Boot)

	// The engine's new epoch goes on normally. The lapse's end may count
	// one message too many as read before it (ingester.markLapseEnd: nats.go
	// counts the last message delivered as pending until its goroutine
	// comes round again): a status round trip first takes that place.
	te.sync()
	te.epoch, te.seq = "ep2", 0
	te.send(added("b", 4))
	st := te.sync()
	require.Equal(t, "ep2", st.Epoch)
	require.False(t, st.Resyncing)
}
