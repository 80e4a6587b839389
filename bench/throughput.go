package bench

import (
	"context"
	"fmt"
	"runtime"
	"runtime/pprof"
	"sync/atomic"

	"github.com/nats-io/nats.go"

	"github.com/kvactors/kvactors/ingest"
)

// Throughput is the event-throughput phase's result.
type Throughput struct {
	Engines        int     `json:"engines"`
	Batches        int     `json:"batches"`
	Events         int     `json:"events"`
	EventsPerBatch float64 `json:"events_per_batch"`
	BytesPerEvent  float64 `json:"bytes_per_event"`
	Seconds        float64 `json:"seconds"`
	// EventsPerSec is every published event (added included) over the time
	// from the first publish until kvactors_events_applied_total counted
	// the last one.
	EventsPerSec float64 `json:"events_per_sec"`
	// CPUSeconds is this process's CPU time over the same intervals (the
	// node, the in-process NATS server and the engines' publishing), and
	// EventsPerCPUSec events over it: the steadier figure on a shared
	// machine, where wall time includes waiting for a core.
	CPUSeconds      float64 `json:"cpu_seconds"`
	EventsPerCPUSec float64 `json:"events_per_cpu_sec"`
	// Raw* is the baseline: a plain subscriber on the same server that
	// receives the same bodies and decodes them with ingest.DecodeBatch.
	RawBatches         int     `json:"raw_batches"`
	RawEvents          int     `json:"raw_events"`
	RawSeconds         float64 `json:"raw_seconds"`
	RawEventsPerSec    float64 `json:"raw_events_per_sec"`
	RawCPUSeconds      float64 `json:"raw_cpu_seconds"`
	RawEventsPerCPUSec float64 `json:"raw_events_per_cpu_sec"`
	Ratio              float64 `json:"ratio"`
	CPURatio           float64 `json:"cpu_ratio"`
	ChunksStored       float64 `json:"chunks_stored"`
	ChunksDeduped      float64 `json:"chunks_deduplicated"`
	Rejected           float64 `json:"rejected"`
}

// maxEvents caps a pre-encoded workload (the latency levels).
const maxEvents = 3_000_000

// newGens makes one generator per engine; the same tag and ids give the
// same batches, byte for byte.
func newGens(tag string, ids []string, w workload, track bool) []*engineGen {
	gens := make([]*engineGen, len(ids))
	for i, id := range ids {
		gens[i] = newEngineGen(id, tag, uint64(i+1)*0x9e37+uint64(len(tag)), eventGeometry(), w)
		if track {
			gens[i].trigger = triggers{}
		}
	}
	return gens
}

// fill encodes each generator's next batches, events/len(gens) events
// each, with batch sizes uniform in 1..64.
func fill(gens []*engineGen, events int) [][]batch {
	out := make([][]batch, len(gens))
	per := max(1, events/len(gens))
	for i, g := range gens {
		for n := 0; n < per; {
			b := g.next(1 + g.rng.IntN(64))
			n += int(b.events)
			out[i] = append(out[i], b)
		}
	}
	return out
}

// mixedStreams is newGens and one fill.
func mixedStreams(tag string, ids []string, events int, w workload, track bool) ([]*engineGen, [][]batch) {
	gens := newGens(tag, ids, w, track)
	return gens, fill(gens, events)
}

func runThroughput(ctx context.Context, cfg Config) (*Throughput, error) {
	ids := engineIDs(cfg.Engines)
	r, conns, err := startEventRig(ctx, cfg, ids)
	if err != nil {
		return nil, err
	}
	defer r.close()
	res := &Throughput{Engines: cfg.Engines}
	var bytes, encoded int
	chunks := func() func() [][]batch {
		gens := newGens("t", ids, mixedWorkload(), false) // the same batches for both runs
		return func() [][]batch {
			chunk := fill(gens, chunkEvents(cfg.Duration))
			for _, bs := range chunk {
				for _, b := range bs {
					bytes += len(b.body)
					encoded += int(b.events)
				}
			}
			return chunk
		}
	}

	runtime.GC()
	if err := rawBaseline(ctx, cfg, r, ids, chunks(), res); err != nil {
		return nil, err
	}
	runtime.GC()
	if cfg.CPUProfile != nil {
		if err := pprof.StartCPUProfile(cfg.CPUProfile); err != nil {
			return nil, fmt.Errorf("cpu profile: %w", err)
		}
	}
	t, err := measure(ctx, cfg, r.nodeSink(ids, conns), chunks(), cfg.Duration)
	if cfg.CPUProfile != nil {
		pprof.StopCPUProfile()
	}
	if err != nil {
		return nil, err
	}
	res.Events, res.Batches, res.Seconds, res.CPUSeconds = t.events, t.batches, t.secs, t.cpu
	res.EventsPerSec, res.EventsPerCPUSec = t.perSec(), t.perCPUSec()
	res.EventsPerBatch = float64(t.events) / float64(max(t.batches, 1))
	res.BytesPerEvent = float64(bytes) / float64(max(encoded, 1))
	res.Ratio = res.EventsPerSec / res.RawEventsPerSec
	res.CPURatio = res.EventsPerCPUSec / res.RawEventsPerCPUSec
	res.ChunksStored = gatherSum(r.reg, mStored, "", "")
	res.ChunksDeduped = gatherSum(r.reg, mDeduped, "", "")
	res.Rejected = gatherSum(r.reg, mRejected, "", "")
	progress(cfg, "throughput: node %.0f events/s, raw %.0f events/s (%d batches, %.1f events/batch)",
		res.EventsPerSec, res.RawEventsPerSec, res.Batches, res.EventsPerBatch)
	return res, nil
}

// rawBaseline publishes the same bodies to a subject only a plain
// subscriber listens on; its callback parses the subject and decodes the
// body, which is what the node does before any actor sees the batch.
func rawBaseline(ctx context.Context, cfg Config, r *rig, ids []string, next func() [][]batch, res *Throughput) error {
	rawPrefix := r.prefix + "_raw"
	nc, err := r.connect("raw-baseline")
	if err != nil {
		return err
	}
	var taken, decoded, bad atomic.Uint64
	sub, err := nc.Subscribe(rawPrefix+".*.events", func(m *nats.Msg) {
		defer taken.Add(1)
		engine, _, err := ingest.ParseSubject(rawPrefix, m.Subject)
		if err != nil {
			bad.Add(1)
			return
		}
		batch, evErrs, err := ingest.DecodeBatch(engine, m.Data, ingest.Limits{})
		if err != nil || len(evErrs) > 0 {
			bad.Add(1)
		}
		decoded.Add(uint64(len(batch.Events)))
	})
	if err != nil {
		return fmt.Errorf("raw subscriber: %w", err)
	}
	defer func() { _ = sub.Unsubscribe() }()
	if err := sub.SetPendingLimits(-1, -1); err != nil {
		return err
	}
	if err := flush(ctx, nc); err != nil {
		return err
	}
	s := sink{taken: taken.Load, progress: func() float64 { return float64(taken.Load()) },
		worth: func(batch) int { return 1 }, what: "the raw subscriber to decode %d batches"}
	for i, id := range ids {
		s.conns = append(s.conns, r.conns[i])
		s.subjects = append(s.subjects, rawPrefix+"."+id+".events")
	}
	t, err := measure(ctx, cfg, s, next, cfg.Duration)
	if err != nil {
		return err
	}
	if n := bad.Load(); n > 0 {
		return fmt.Errorf("raw baseline: %d batches failed to decode (a generator bug)", n)
	}
	if got := decoded.Load(); got != uint64(t.events) {
		return fmt.Errorf("raw baseline: decoded %d events, published %d (a generator bug)", got, t.events)
	}
	res.RawBatches, res.RawEvents, res.RawSeconds, res.RawCPUSeconds = t.batches, t.events, t.secs, t.cpu
	res.RawEventsPerSec, res.RawEventsPerCPUSec = t.perSec(), t.perCPUSec()
	return nil
}
