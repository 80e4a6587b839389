package transfer

import (
	"context"
	"log/slog"
	"time"

	"github.com/asynkron/protoactor-go/actor"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"github.com/kvactors/kvactors/actors"
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
	// Fence, when set, holds copies back while NATS is unreachable.
	Fence *Fence
}

// Actor is the transfer actor of one device. It owns the queue and its
// workers; the workers take jobs from the queue and report each end as a
// message, so JobDone, metrics and spans are handled here, in Receive.
type Actor struct {
	deps Deps
	q    *queue
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
		a.q.close() // workers finish the copy they hold and exit
	case *actor.Stopped, *actor.Restarting:
	case *Submit:
		a.q.push(m)
	case *Cancel:
		for _, s := range a.q.cancel(m.Owner, m.IDs) {
			s.completePool(false)
			c.Send(s.Owner, &JobDone{ID: s.ID, Cancelled: true})
		}
	case *copyDone:
		a.finish(c, m)
	default:
		a.deps.Metrics.Unexpected.WithLabelValues(actors.KindTransfer).Inc()
	}
	queued, running, inflight := a.q.stats()
	a.deps.Metrics.JobsQueued.Set(float64(queued))
	a.deps.Metrics.JobsInFlight.Set(float64(running))
	a.deps.Metrics.BytesInFlight.Set(float64(inflight))
}

func (a *Actor) start(c actor.Context) {
	a.q = newQueue(a.deps.Config.MaxInFlightBytes)
	self, root := c.Self(), c.ActorSystem().Root
	for range a.deps.Config.Workers {
		go a.worker(root, self)
	}
}

func (a *Actor) finish(c actor.Context, d *copyDone) {
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

// copy runs one job's backend copy inside the fence (if any).
func (a *Actor) copy(job *Submit, ranges []backend.Range) error {
	if f := a.deps.Fence; f != nil {
		if err := f.Enter(); err != nil {
			return err
		}
		defer f.Leave()
	}
	return job.Device.Copy(job.Dir, a.deps.Arena, ranges)
}

// worker runs copies until the queue closes: the backend call, the pool's
// completion, then a message to the actor.
func (a *Actor) worker(root *actor.RootContext, self *actor.PID) {
	var ranges []backend.Range
	for job := a.q.next(); job != nil; job = a.q.next() {
		if !job.Arrived.IsZero() {
			a.deps.Metrics.DecisionTime.Observe(time.Since(job.Arrived).Seconds())
		}
		ranges = sched.Ranges(job.Layout, job.Chunks, job.SlotBytes, ranges[:0])
		ctx := trace.ContextWithSpanContext(context.Background(), job.Span)
		_, span := a.deps.Tracer.Start(ctx, tracing.SpanCopy)
		if span.IsRecording() {
			span.SetAttributes(tracing.AttrEngine.String(job.Engine), tracing.AttrDirection.String(job.Dir.String()),
				tracing.AttrBytes.Int64(job.Bytes), tracing.AttrChunks.Int(len(job.Chunks)))
		}
		start := time.Now()
		err := a.copy(job, ranges)
		dur := time.Since(start)
		job.completePool(err == nil)
		a.q.done(job)
		if err != nil {
			span.RecordError(err)
			span.SetStatus(codes.Error, err.Error())
		}
		span.End()
		root.Send(self, &copyDone{job: job, err: err, dur: dur})
	}
}
