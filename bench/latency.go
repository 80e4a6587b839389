package bench

import (
	"context"
	"fmt"
	"math"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvactors/kvactors/ingest"
)

// Latency is the latency phase's result: one level per fraction of the
// saturation rate.
type Latency struct {
	SaturationEventsPerSec float64        `json:"saturation_events_per_sec"`
	Levels                 []LatencyLevel `json:"levels"`
}

// LatencyLevel is one paced run. Client* is measured by the engines: from
// publishing the batch that made a job's last chunk ready to the job's
// stored message arriving, an upper bound of publish → copy start (it adds
// the copy and the stored message's trip). Node* is the node's
// kvactors_store_decision_seconds histogram over the same run: batch taken
// off the node's subscription → copy start, interpolated inside its buckets.
type LatencyLevel struct {
	Fraction         float64 `json:"fraction"`
	TargetPerSec     float64 `json:"target_events_per_sec"`
	AchievedPerSec   float64 `json:"achieved_events_per_sec"`
	Events           int     `json:"events"`
	Jobs             int     `json:"jobs"`
	Unmatched        int     `json:"unmatched_jobs"`
	ClientP50MS      float64 `json:"client_p50_ms"`
	ClientP99MS      float64 `json:"client_p99_ms"`
	ClientP999MS     float64 `json:"client_p999_ms"`
	NodeJobs         uint64  `json:"node_jobs"`
	NodeP50MS        float64 `json:"node_p50_ms"`
	NodeP99MS        float64 `json:"node_p99_ms"`
	NodeP999MS       float64 `json:"node_p999_ms"`
	RejectedOrFailed float64 `json:"rejected"`
}

// latencyFractions are the paced rates, as fractions of saturation.
var latencyFractions = []float64{0.25, 0.5, 0.9}

func runLatency(ctx context.Context, cfg Config, saturation float64) (*Latency, error) {
	res := &Latency{SaturationEventsPerSec: saturation}
	for _, f := range latencyFractions {
		lvl, err := latencyLevel(ctx, cfg, f, saturation*f)
		if err != nil {
			return nil, fmt.Errorf("latency at %.0f%%: %w", f*100, err)
		}
		res.Levels = append(res.Levels, *lvl)
		progress(cfg, "latency at %.0f%% (%.0f events/s): client p99 %.3f ms, node p99 %.3f ms (%d jobs)",
			f*100, lvl.AchievedPerSec, lvl.ClientP99MS, lvl.NodeP99MS, lvl.Jobs)
	}
	return res, nil
}

// sampler collects client-side latencies from stored messages.
type sampler struct {
	mu        sync.Mutex
	samples   []time.Duration
	unmatched int
	last      atomic.Int64 // unix nanos of the latest stored message
}

// onStored attributes a stored job to the batch that made its last chunk
// ready and records publish → arrival.
func (s *sampler) onStored(g *engineGen, published []atomic.Int64, m *nats.Msg) {
	now := time.Now()
	s.last.Store(now.UnixNano())
	trigger := -1
	// The SDK's decoder: the bench's side of a stored message costs what an
	// engine's does, and encoding/json's cost here was a third of the
	// bench's CPU in the external levels, on cores the child shares.
	if st, err := ingest.DecodeStored(m.Data); err == nil {
		trigger = g.trigger.of(&st)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if trigger < 0 || trigger >= len(published) || published[trigger].Load() == 0 {
		s.unmatched++
		return
	}
	s.samples = append(s.samples, now.Sub(time.Unix(0, published[trigger].Load())))
}

func latencyLevel(ctx context.Context, cfg Config, fraction, rate float64) (*LatencyLevel, error) {
	ids := engineIDs(cfg.Engines)
	w := mixedWorkload()
	w.shared = 0 // every ready chunk is stored, so every job is seen
	events := min(maxEvents, int(rate*cfg.Duration.Seconds()))
	gens, perEngine := mixedStreams(fmt.Sprintf("l%.0f", fraction*100), ids, events, w, true)

	r, err := startRig(ctx, cfg, eventPoolBytes)
	if err != nil {
		return nil, err
	}
	defer r.close()
	var s sampler
	published := make([][]atomic.Int64, len(ids))
	streams := make([]stream, len(ids))
	for i, id := range ids {
		nc, _, err := r.engine(ctx, id, eventGeometry())
		if err != nil {
			return nil, err
		}
		published[i] = make([]atomic.Int64, len(perEngine[i]))
		g, pub := gens[i], published[i]
		if _, err := nc.Subscribe(r.subject(id, "stored"), func(m *nats.Msg) { s.onStored(g, pub, m) }); err != nil {
			return nil, err
		}
		if err := flush(ctx, nc); err != nil {
			return nil, err
		}
		streams[i] = stream{nc: nc, subject: r.subject(id, "events"), batches: perEngine[i]}
	}
	total, events := 0, 0
	for _, st := range streams {
		total += len(st.batches)
		for _, b := range st.batches {
			events += int(b.events)
		}
	}
	batchRate := rate / (float64(events) / float64(total))
	before := snapshot(r.reg, mDecision)
	appliedBase := r.applied()

	start, last, err := pace(ctx, streams, published, batchRate)
	if err != nil {
		return nil, err
	}
	applied := 0
	for _, st := range streams {
		for _, b := range st.batches {
			applied += int(b.applied)
		}
	}
	if err := waitFor(ctx, fmt.Sprintf("the node to apply %d events", applied), 30*time.Second,
		func() bool { return r.applied()-appliedBase >= float64(applied) }); err != nil {
		return nil, err
	}
	// Stored messages trail the last batch by a copy: wait until none has
	// arrived for 50ms.
	_ = waitFor(ctx, "stored messages to stop arriving", 5*time.Second, func() bool {
		return time.Since(time.Unix(0, s.last.Load())) > 50*time.Millisecond
	})
	for _, nc := range r.conns {
		_ = nc.Drain()
	}
	_ = waitFor(ctx, "engine connections to drain", 5*time.Second, func() bool {
		for _, nc := range r.conns {
			if !nc.IsClosed() {
				return false
			}
		}
		return true
	})
	node := snapshot(r.reg, mDecision).minus(before)
	s.mu.Lock()
	defer s.mu.Unlock()
	slices.Sort(s.samples)
	lvl := &LatencyLevel{Fraction: fraction, TargetPerSec: rate, Events: events, Jobs: len(s.samples),
		Unmatched: s.unmatched, NodeJobs: node.count(), RejectedOrFailed: gatherSum(r.reg, mRejected, "", "")}
	if secs := last.Sub(start).Seconds(); secs > 0 {
		lvl.AchievedPerSec = float64(events) / secs
	}
	lvl.ClientP50MS, lvl.ClientP99MS, lvl.ClientP999MS = pct(s.samples, 0.5), pct(s.samples, 0.99), pct(s.samples, 0.999)
	lvl.NodeP50MS, lvl.NodeP99MS, lvl.NodeP999MS = node.quantile(0.5)*1e3, node.quantile(0.99)*1e3, node.quantile(0.999)*1e3
	return lvl, nil
}

// pace publishes the streams' batches round-robin at batchRate batches/s,
// recording each batch's publish time. Timers on a busy machine fire about
// every millisecond, so batches leave in per-tick bursts, as an engine's
// scheduler step would send them.
func pace(ctx context.Context, streams []stream, published [][]atomic.Int64, batchRate float64) (start, last time.Time, err error) {
	sent := make([]int, len(streams))
	total := 0
	for _, s := range streams {
		total += len(s.batches)
	}
	start = time.Now()
	for n := 0; n < total; {
		if err := ctx.Err(); err != nil {
			return start, last, err
		}
		due := min(total, int(time.Since(start).Seconds()*batchRate)+1)
		for ; n < due; n++ {
			i := n % len(streams)
			for sent[i] >= len(streams[i].batches) { // a stream that ran out
				i = (i + 1) % len(streams)
			}
			now := time.Now()
			published[i][sent[i]].Store(now.UnixNano())
			if err := streams[i].nc.Publish(streams[i].subject, streams[i].batches[sent[i]].body); err != nil {
				return start, last, fmt.Errorf("publish: %w", err)
			}
			sent[i]++
			last = now
		}
		if wait := time.Until(start.Add(time.Duration(float64(n) / batchRate * 1e9))); wait > 0 {
			time.Sleep(wait)
		}
	}
	return start, last, nil
}

// pct is the q-quantile of sorted samples, in milliseconds.
func pct(sorted []time.Duration, q float64) float64 {
	if len(sorted) == 0 {
		return 0 // no samples: Jobs says so (JSON has no NaN)
	}
	i := min(len(sorted)-1, int(math.Ceil(q*float64(len(sorted))))-1)
	return float64(sorted[max(i, 0)]) / 1e6
}
