package sim

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"go.opentelemetry.io/otel/trace"

	"github.com/kvactors/kvactors/client"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/tracing"
)

// engine is one simulated engine for the length of one Run. Everything but
// kv (shared with the kv_events callback) belongs to Run's goroutine.
type engine struct {
	cfg Config
	nc  *nats.Conn
	log *slog.Logger
	// tracer is nil without Config.Tracer.
	tracer trace.Tracer
	mem    *memory
	al     *allocator

	subject string // P.E. (messages.EngineSubject with no verb)
	// c is the SDK session (epochs, seq, heartbeats, resyncs); b hands it
	// one step's events.
	c        *client.Client
	b        events
	closing  chan struct{} // closed when Run stops reading msgs
	batches  atomic.Int64  // published, counted in the SDK's publish hook
	nevents  atomic.Int64
	prefixes [][]uint32
	lcmBlock int // every group's block size divides it: resume hits are multiples of it

	reqs     []*request
	byID     map[string]*request
	waiting  []*request // FIFO; preempted requests go back to the front
	running  []*request // in scheduling order; the last is preempted first
	doomed   []*request // queued, to be aborted before any block
	arrivals *arrivals
	ended    int // requests finished or aborted
	owed     int // releases owed and not yet received
	// heldBlocks counts block ids waiting for `released` before reuse.
	heldBlocks int

	storedKeys map[string]keyRef // every key this engine was told is stored
	msgs       chan any          // client.Release or messages.Stored, in arrival order
	kv         kvState

	rep          Report
	lastProgress time.Time
}

// keyRef is where a stored key was first reported.
type keyRef struct {
	req *request
	ch  chunkRef
}

// kvState is what the kv_events subscription learnt; its callback runs on
// the NATS client's goroutine, hence the lock.
type kvState struct {
	mu        sync.Mutex
	evicted   map[string]bool // key hex
	evictions int
	processed uint64 // kv_events messages handled, to tell when the queue is drained
}

// Run registers the engine with the kvactors node reachable on nc, serves
// cfg.Requests simulated requests, then checks what kvactors did (see the
// package doc). The error is for what stopped the run (bad config, NATS,
// shared memory, ctx, a stall); failed checks are in Report.Err. The
// Report is filled as far as the run got either way.
func Run(ctx context.Context, nc *nats.Conn, cfg Config) (Report, error) {
	start := time.Now()
	e, err := newEngine(nc, cfg)
	if err != nil {
		return Report{Engine: cfg.Engine}, err
	}
	defer func() {
		if rerr := e.mem.remove(); rerr != nil {
			e.log.Warn("sim: remove segments", "engine", cfg.Engine, "err", rerr)
		}
	}()
	err = e.run(ctx)
	e.rep.Elapsed = time.Since(start)
	e.rep.Interrupted = ctx.Err() != nil
	e.rep.CheckSkipped = err != nil // run returns nil only once the check finished
	e.rep.Batches, e.rep.Events = int(e.batches.Load()), int(e.nevents.Load())
	return e.rep.clone(), err
}

func newEngine(nc *nats.Conn, cfg Config) (*engine, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if cfg.Log == nil {
		cfg.Log = slog.Default()
	}
	e := &engine{cfg: cfg, nc: nc, log: cfg.Log, subject: messages.EngineSubject(cfg.Prefix, cfg.Engine, ""),
		byID: map[string]*request{}, storedKeys: map[string]keyRef{}, closing: make(chan struct{}),
		msgs: make(chan any, 1<<16), lcmBlock: 1,
		rep: Report{Engine: cfg.Engine, Releases: map[string]int{}}}
	e.kv.evicted = map[string]bool{}
	if cfg.Tracer != nil {
		e.tracer = cfg.Tracer.Tracer("github.com/kvactors/kvactors/sim")
	}
	for _, g := range cfg.Groups {
		e.lcmBlock = lcm(e.lcmBlock, g.TokensPerBlock)
	}
	e.prefixes = sharedPrefixes(&e.cfg)
	e.arrivals = newArrivals(&e.cfg)
	e.al = newAllocator(&e.cfg)
	mem, err := newMemory(&e.cfg)
	if err != nil {
		return nil, err
	}
	e.mem = mem
	return e, nil
}

func (e *engine) run(ctx context.Context) error {
	subs, err := e.subscribe()
	defer func() {
		for _, s := range subs {
			_ = s.Unsubscribe()
		}
	}()
	if err != nil {
		return err
	}
	if err := e.connect(ctx); err != nil {
		return err
	}
	defer e.disconnect()
	served := time.Now()
	err = e.serve(ctx)
	e.rep.Serving = time.Since(served)
	if err != nil {
		e.settleReleases()
		return err
	}
	if err := e.waitLive(ctx); err != nil {
		return err
	}
	if e.cfg.BeforeCheck != nil {
		e.cfg.BeforeCheck()
	}
	if err := e.verify(ctx, subs[len(subs)-1]); err != nil {
		return err
	}
	e.settleReleases()
	return nil
}

// subscribe listens for every engine's kv_events (evictions anywhere can
// remove a key this engine stored); the SDK listens for the rest.
func (e *engine) subscribe() ([]*nats.Subscription, error) {
	var subs []*nats.Subscription
	s, err := e.nc.Subscribe(e.cfg.Prefix+".*.kv_events", e.onKVEvents)
	if err != nil {
		return subs, fmt.Errorf("sim: subscribe kv_events: %w", err)
	}
	subs = append(subs, s)
	if err := e.nc.Flush(); err != nil {
		return subs, fmt.Errorf("sim: flush subscriptions: %w", err)
	}
	return subs, nil
}

// request does one request/reply on P.E.verb with JSON bodies.
func (e *engine) request(verb string, body, reply any) error {
	data, err := json.Marshal(body)
	if err != nil {
		return fmt.Errorf("sim: encode %s: %w", verb, err)
	}
	m, err := e.nc.Request(e.subject+verb, data, e.cfg.RequestTimeout)
	if err != nil {
		return fmt.Errorf("sim: engine %s: %s: %w", e.cfg.Engine, verb, err)
	}
	if err := json.Unmarshal(m.Data, reply); err != nil {
		return fmt.Errorf("sim: engine %s: decode %s reply %q: %w", e.cfg.Engine, verb, m.Data, err)
	}
	return nil
}

// ErrStalled is returned when the run made no progress for StallTimeout.
var ErrStalled = errors.New("sim: stalled")

// serve runs scheduler steps until every request ended and every release
// owed arrived.
func (e *engine) serve(ctx context.Context) error {
	tick := time.NewTicker(e.cfg.StepInterval)
	defer tick.Stop()
	e.lastProgress = time.Now()
	for e.ended < e.cfg.Requests || e.owed > 0 {
		select {
		case <-ctx.Done():
			return fmt.Errorf("sim: engine %s: %w", e.cfg.Engine, ctx.Err())
		case m := <-e.msgs:
			e.handle(m)
		case now := <-tick.C:
			if now.Sub(e.lastProgress) > e.cfg.StallTimeout {
				return fmt.Errorf("%w: engine %s: nothing happened for %v: %d of %d requests ended, %d running, "+
					"%d waiting, %d releases owed", ErrStalled, e.cfg.Engine, e.cfg.StallTimeout, e.ended,
					e.cfg.Requests, len(e.running), len(e.waiting), e.owed)
			}
			if err := e.step(); err != nil {
				return err
			}
		}
	}
	return nil
}

// publish ends the step: the SDK sends its events as one batch (or starts
// a new epoch that re-announces them, when a resync is due).
func (e *engine) publish() error {
	if err := e.c.Flush(); err != nil {
		return fmt.Errorf("sim: engine %s: %w", e.cfg.Engine, err)
	}
	return nil
}

// beforePublish counts each batch the SDK publishes and, with a tracer,
// wraps it in a span whose context travels in the NATS headers.
func (e *engine) beforePublish(msg *nats.Msg, seq uint64, events int) {
	e.batches.Add(1)
	e.nevents.Add(int64(events))
	if e.tracer != nil {
		ctx, span := e.tracer.Start(context.Background(), SpanStep, trace.WithAttributes(
			tracing.AttrEngine.String(e.cfg.Engine), tracing.AttrSeq.Int64(int64(seq)),
			tracing.AttrEvents.Int(events)))
		tracing.InjectMsg(ctx, msg)
		span.End()
	}
}

// SpanStep is the engine's span around one published batch.
const SpanStep = "sim.step"

// progress marks that something moved, for stall detection.
func (e *engine) progress() { e.lastProgress = time.Now() }

func lcm(a, b int) int {
	x, y := a, b
	for y != 0 {
		x, y = y, x%y
	}
	return a / x * b
}
