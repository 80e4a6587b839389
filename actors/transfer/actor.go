package transfer

import (
	"context"
	"log/slog"
	"time"

	"github.com/asynkron/protoactor-go/actor"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"github.com/kvactors/kvactors/backend"
	"github.com/kvactors/kvactors/metrics"
	"github.com/kvactors/kvactors/sched"
	"github.com/kvactors/kvactors/tracing"
)

// Config bounds one device's copies.
type Config struct {
	// Workers is the number of copies running at once (default 2).
	Workers int
	// MaxInFlightBytes bounds the bytes of running copies; a job larger than
	// the bound still runs, alone (default 256 MiB).
	MaxInFlightBytes int64
}

// DefaultConfig is 2 workers and 256 MiB in flight.
func DefaultConfig() Config { return Config{Workers: 2, MaxInFlightBytes: 256 << 20} }

func (c Config) withDefaults() Config {
	d := DefaultConfig()
	if c.Workers <= 0 {
		c.Workers = d.Workers
	}
	if c.MaxInFlightBytes <= 0 {
		c.MaxInFlightBytes = d.MaxInFlightBytes
	}
	return c
}

// Deps is what the actor needs from its node.
type Deps struct {
	Config  Config
	Arena   backend.Arena
	Metrics *metrics.Metrics
	Tracer  trace.Tracer
	Log     *slog.Logger
}

// Actor is the transfer actor of one device. Its state is touched only from
// Receive; workers talk to it by message.
type Actor struct {
	deps     Deps
	work     chan *Submit
	queue    []*Submit
	running  int
	inflight int64
}

// Props builds a transfer actor. Its workers stop when it stops.
func Props(deps Deps) *actor.Props {
	deps.Config = deps.Config.withDefaults()
	return actor.PropsFromProducer(func() actor.Actor { return &Actor{deps: deps} })
}

func (a *Actor) Receive(c actor.Context) {
	switch m := c.Message().(type) {
	case *actor.Started:
		a.start(c)
	case *actor.Stopping:
		close(a.work) // workers drain what they hold and exit
	case *actor.Stopped, *actor.Restarting:
	case *Submit:
		a.enqueue(m)
		a.dispatch()
	case *Cancel:
		a.cancel(c, m)
	case *copyDone:
		a.finish(c, m)
		a.dispatch()
	default:
		a.deps.Metrics.Unexpected.WithLabelValues("transfer").Inc()
	}
	a.deps.Metrics.JobsQueued.Set(float64(len(a.queue)))
}

func (a *Actor) start(c actor.Context) {
	a.work = make(chan *Submit, a.deps.Config.Workers)
	self, root := c.Self(), c.ActorSystem().Root
	for range a.deps.Config.Workers {
		go a.worker(root, self, a.work)
	}
}

// enqueue puts loads ahead of stores: a load is on a request's time to first
// token, a store only has to happen before the blocks are released.
func (a *Actor) enqueue(s *Submit) {
	if s.Dir != backend.HostToDevice {
		a.queue = append(a.queue, s)
		return
	}
	i := 0
	for i < len(a.queue) && a.queue[i].Dir == backend.HostToDevice {
		i++
	}
	a.queue = append(a.queue, nil)
	copy(a.queue[i+1:], a.queue[i:])
	a.queue[i] = s
}

// dispatch starts queued jobs while a worker is free and the in-flight bound
// allows (a job bigger than the bound runs when nothing else is in flight).
func (a *Actor) dispatch() {
	for len(a.queue) > 0 && a.running < a.deps.Config.Workers {
		next := a.queue[0]
		if a.inflight > 0 && a.inflight+next.Bytes > a.deps.Config.MaxInFlightBytes {
			return
		}
		a.queue[0] = nil
		a.queue = a.queue[1:]
		a.running++
		a.inflight += next.Bytes
		if !next.Arrived.IsZero() {
			a.deps.Metrics.DecisionTime.Observe(time.Since(next.Arrived).Seconds())
		}
		a.work <- next // never blocks: running < Workers = cap(work)
	}
	a.deps.Metrics.JobsInFlight.Set(float64(a.running))
	a.deps.Metrics.BytesInFlight.Set(float64(a.inflight))
}

func (a *Actor) cancel(c actor.Context, m *Cancel) {
	kept := a.queue[:0]
	for _, s := range a.queue {
		if s.Owner.Equal(m.Owner) && containsID(m.IDs, s.ID) {
			s.completePool(false)
			c.Send(s.Owner, &JobDone{ID: s.ID, Cancelled: true})
			continue
		}
		kept = append(kept, s)
	}
	clear(a.queue[len(kept):])
	a.queue = kept
}

func (a *Actor) finish(c actor.Context, d *copyDone) {
	a.running--
	a.inflight -= d.job.Bytes
	dir := d.job.Dir.String()
	if d.err != nil {
		a.deps.Metrics.CopyFailures.WithLabelValues(dir).Inc()
	} else {
		a.deps.Metrics.TransferBytes.WithLabelValues(dir).Add(float64(d.job.Bytes))
		a.deps.Metrics.TransferTime.WithLabelValues(dir).Add(d.dur.Seconds())
		a.deps.Metrics.CopySize.WithLabelValues(dir).Observe(float64(d.job.Bytes))
	}
	c.Send(d.job.Owner, &JobDone{ID: d.job.ID, Err: d.err, Bytes: d.job.Bytes, Duration: d.dur})
}

// worker runs copies until the work channel closes. Only the backend call
// happens here; results go back to the actor as messages.
func (a *Actor) worker(root *actor.RootContext, self *actor.PID, work <-chan *Submit) {
	var ranges []backend.Range
	for job := range work {
		ranges = sched.Ranges(job.Layout, job.Chunks, job.SlotBytes, ranges[:0])
		ctx := trace.ContextWithSpanContext(context.Background(), job.Span)
		_, span := a.deps.Tracer.Start(ctx, tracing.SpanCopy, trace.WithAttributes(
			tracing.AttrEngine.String(job.Engine),
			tracing.AttrDirection.String(job.Dir.String()),
			tracing.AttrBytes.Int64(job.Bytes),
			tracing.AttrChunks.Int(len(job.Chunks))))
		start := time.Now()
		err := job.Device.Copy(job.Dir, a.deps.Arena, ranges)
		dur := time.Since(start)
		job.completePool(err == nil)
		if err != nil {
			span.RecordError(err)
			span.SetStatus(codes.Error, err.Error())
		}
		span.End()
		root.Send(self, &copyDone{job: job, err: err, dur: dur})
	}
}

func containsID(ids []sched.JobID, id sched.JobID) bool {
	for _, x := range ids {
		if x == id {
			return true
		}
	}
	return false
}
