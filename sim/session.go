package sim

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sync"
	"time"

	"github.com/kvactors/kvactors/client"
	"github.com/kvactors/kvactors/messages"
)

// connect starts the engine's SDK session: register (retried until ctx
// ends), heartbeats, resyncs. Releases and stored messages come back on
// e.msgs, in the order the SDK got them.
func (e *engine) connect(ctx context.Context) error {
	cfg := client.Config{Engine: e.cfg.Engine, Prefix: e.cfg.Prefix, Spec: e.mem.spec(),
		RequestTimeout: e.cfg.RequestTimeout, Log: e.log, BeforePublish: e.beforePublish,
		OnReleased: func(r client.Release) { e.deliver(r) },
		OnStored:   func(s messages.Stored) { e.deliver(s) }}
	if p := e.cfg.DropBatches; p > 0 {
		var mu sync.Mutex // DropBatch runs under the SDK's lock, but on more than one goroutine
		rng := rand.New(rand.NewPCG(e.cfg.Seed, stringSeed(e.cfg.Engine)^stringSeed("drop")))
		cfg.DropBatch = func(uint64) bool {
			mu.Lock()
			defer mu.Unlock()
			return rng.Float64() < p
		}
	}
	if e.cfg.SDK != nil {
		e.cfg.SDK(&cfg)
	}
	c, err := client.Connect(ctx, e.nc, cfg)
	if err != nil {
		return fmt.Errorf("sim: engine %s: %w", e.cfg.Engine, err)
	}
	e.c = c
	e.b.c = c
	return nil
}

// deliver hands a callback's value to Run's goroutine, or drops it once Run
// stopped listening (so the SDK's Close never waits on a full channel).
func (e *engine) deliver(v any) {
	select {
	case e.msgs <- v:
	case <-e.closing:
	}
}

// disconnect ends the session (unregister) and copies the SDK's counters
// into the report.
func (e *engine) disconnect() {
	close(e.closing)
	st := e.c.Stats()
	if err := e.c.Close(); err != nil {
		e.log.Debug("sim: close session", "engine", e.cfg.Engine, "err", err)
	}
	e.rep.takeSDKStats(st)
}

// takeSDKStats copies the SDK's counters the report shows and checks.
func (r *Report) takeSDKStats(st client.Stats) {
	r.DroppedBatches = st.DroppedBatches
	r.NodeLosses = st.NodeLosses
	r.RefusedEvents = st.BadRequestIDs + st.OutOfRange + st.BadHashes
	r.DroppedIncoming = st.DroppedIncoming
	r.Awaiting = st.Awaiting
	r.UnexpectedReleases = st.UnexpectedRel
	r.UnowedResets = st.UnowedResets
	r.ResyncsBy = st.Resyncs
	for _, n := range st.Resyncs {
		r.Resyncs += n
	}
}

// events hands one scheduler step's events to the SDK, in wire.Batch's
// appender shape so that the scheduler reads as it always did.
type events struct {
	c      *client.Client
	n      int
	hreq   string
	hstart int
	hashes [][]byte
}

func (b *events) Reset()      { b.n = 0 }
func (b *events) Events() int { return b.n }

func (b *events) Added(req string, prompt int) { b.n++; b.c.Added(req, prompt) }

func (b *events) BeginHashes(req string, start int) {
	b.hreq, b.hstart, b.hashes = req, start, b.hashes[:0]
}
func (b *events) Hash(h []byte) { b.hashes = append(b.hashes, h) }
func (b *events) EndHashes()    { b.n++; b.c.Hashes(b.hreq, b.hstart, b.hashes...) }

func (b *events) Blocks(req string, group, start int, ids []uint32) {
	b.n++
	b.c.Blocks(req, group, start, ids)
}

func (b *events) Tokens(req string, computed, total int) { b.n++; b.c.Tokens(req, computed, total) }
func (b *events) Preempted(req string)                   { b.n++; b.c.Preempted(req) }
func (b *events) Resumed(req string)                     { b.n++; b.c.Resumed(req) }

func (b *events) Finished(req string, aborted bool, computed, total int) {
	b.n++
	b.c.Finished(req, aborted, computed, total)
}

// waitLive waits, at most StallTimeout, until the SDK's session is up, so
// that the final check talks to a node that knows the engine (after a node
// loss the last requests may end before the engine registers again).
func (e *engine) waitLive(ctx context.Context) error {
	deadline := time.NewTimer(e.cfg.StallTimeout)
	defer deadline.Stop()
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	for !e.c.Live() {
		select {
		case <-ctx.Done():
			return fmt.Errorf("sim: engine %s: %w", e.cfg.Engine, ctx.Err())
		case <-deadline.C:
			return fmt.Errorf("%w: engine %s: no live session for %v before the check", ErrStalled, e.cfg.Engine,
				e.cfg.StallTimeout)
		case <-tick.C: // the SDK has no event to wait on for this
		}
	}
	return nil
}
