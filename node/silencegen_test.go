package node_test

import (
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/node"
)

// stallSilenced is a slog handler that holds the goroutine logging the
// engine actor's "engine silent for lease/2" warning (silenced, before its
// resetAll) until release is closed: it widens the window between the
// intake's h.Heard(at) and the engine actor's reset.
// stallSilenced holds the engine actor in its "engine silent" log line
// (entered closes then) until release closes.
type stallSilenced struct {
	slog.Handler
	entered chan struct{}
	release chan struct{}
	once    *sync.Once
}

func (h stallSilenced) Handle(ctx context.Context, r slog.Record) error {
	if strings.HasPrefix(r.Message, "engine silent for lease/2") {
		h.once.Do(func() { close(h.entered) })
		<-h.release
	}
	return h.Handler.Handle(ctx, r)
}
func (h stallSilenced) WithAttrs(a []slog.Attr) slog.Handler {
	return stallSilenced{h.Handler.WithAttrs(a), h.entered, h.release, h.once}
}
func (h stallSilenced) WithGroup(g string) slog.Handler {
	return stallSilenced{h.Handler.WithGroup(g), h.entered, h.release, h.once}
}

// After lease/2 of silence, the first message of the engine must keep every
// copy of the old epoch from starting ("nothing of the old epoch is applied
// or copied again"). ingester.heard sends engine.Silenced and then at once
// refreshes the Hearing, so a copy of an old request already queued (or a
// retry) passes heardRecently before the reset reaches the request actor and
// its Cancel reaches the transfer actor.
// The message that ends an engine's silence refreshes when the node heard
// it at once, while the reset of the old requests it brings reaches their
// queued copies a few hops later (engine actor, request actors, transfer
// actor). Held in that window (the engine actor stalls in its "engine
// silent" log line), a queued copy of the old epoch still never starts: it
// carries the silence generation its epoch began in (transfer.Hearing.Gen).
func TestACopyOfAnEpochBeforeASilenceNeverStarts(t *testing.T) {
	const lease = time.Minute
	start := time.Unix(1_800_000_000, 0)
	var clock atomic.Int64
	clock.Store(start.UnixNano())
	dev := &heldDevice{started: make(chan struct{}, 8), gate: make(chan struct{}, 8)}
	h := stallSilenced{Handler: slog.NewTextHandler(io.Discard, nil), entered: make(chan struct{}),
		release: make(chan struct{}), once: &sync.Once{}}
	e := startNode(t, func(c *node.Config) {
		c.Lease = lease
		c.Transfer.Workers = 1
		c.WrapDevice = dev.wrap
		c.Log = slog.New(h)
	}, node.WithClock(func() time.Time { return time.Unix(0, clock.Load()) }))
	t.Cleanup(func() { close(dev.gate) })
	t.Cleanup(func() { close(h.release) }) // runs before the node's Close
	te := e.newEngine("e1", defaultOpts())
	te.register()
	heldAndQueued(t, te, dev) // a copying, b queued (both of epoch ep1)

	clock.Store(start.Add(lease / 2).UnixNano()) // nothing heard since start
	// The engine is heard again (a heartbeat; a late batch or a lookup does
	// the same). Published, not requested: its reply waits on the reset.
	data, _ := json.Marshal(map[string]any{"epoch": te.epoch, "seq": te.seq})
	if err := e.nc.Publish("kvactors.e1.heartbeat", data); err != nil {
		t.Fatal(err)
	}
	select {
	case <-h.entered:
	case <-time.After(5 * time.Second):
		t.Fatal("engine.Silenced not handled")
	}
	dev.gate <- struct{}{} // a ends; the worker takes b while the reset is held
	testkit.NoRecv(t, dev.started, 300*time.Millisecond, "copy b of the silenced epoch starting before its reset")
}
