package bench

import (
	"context"
	"fmt"
	"io"
	"math"
	"slices"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"
)

// ExternalLatencyLevel is one paced level of the out-of-process run: the
// latency phase's figures plus the CPU both processes spent on it, from the
// first publish until the stored messages stopped (NodeCPUSeconds is the
// child's, BenchCPUSeconds this process's: pacing, stored-message parsing).
type ExternalLatencyLevel struct {
	LatencyLevel
	NodeCPUSeconds  float64 `json:"node_cpu_seconds"`
	NodeUSPerEvent  float64 `json:"node_us_per_event"`
	BenchCPUSeconds float64 `json:"bench_cpu_seconds"`
	// GCCycles is how many collections the child ran during the level
	// (go_gc_duration_seconds' count): a collection's mark phase takes a
	// quarter of the node's processors and makes allocating goroutines
	// assist, which is where the level's tail latency comes from.
	GCCycles int `json:"node_gc_cycles"`
	// Per event, the child's context switches (all threads) and read and
	// write system calls over the level: the wake-ups and kernel trips
	// behind its CPU per event at low rates.
	NodeSwitchesPerEvent float64 `json:"node_switches_per_event"`
	NodeSyscallsPerEvent float64 `json:"node_syscalls_per_event"`
	// NodeQueueWait* is the part of node latency after the store job's
	// submission: its wait for a copy worker (the child's
	// kvactors_transfer_queue_wait_seconds).
	NodeQueueWaitP50MS float64 `json:"node_queue_wait_p50_ms"`
	NodeQueueWaitP99MS float64 `json:"node_queue_wait_p99_ms"`
	// NodeStored* run on past the copy to the stored message's publish
	// (the child's kvactors_store_stored_seconds): the node's whole part
	// of the client's latency; the rest is NATS delivery both ways and
	// this process.
	NodeStoredP50MS float64 `json:"node_stored_p50_ms"`
	NodeStoredP99MS float64 `json:"node_stored_p99_ms"`
	// NodeIntakeWait* is each batch's wait for its ingest worker (the
	// child's kvactors_ingest_wait_seconds), over every batch of the level.
	NodeIntakeWaitP50MS float64 `json:"node_intake_wait_p50_ms"`
	NodeIntakeWaitP99MS float64 `json:"node_intake_wait_p99_ms"`
	// The Go runtime's account of the level's tail (metrics.runtimeTail;
	// zero against a node built before it): the collector's share of the
	// child's busy CPU, both the runtime's estimates (an overestimate,
	// counted per cycle when the cycle ends, so a level's share is off by
	// up to one cycle); the share of goroutine transitions to runnable that
	// waited over ~1 ms and over ~10 ms for a processor (the runtime samples
	// one in eight, RunnableSamples of them here; the exported histogram
	// has bounds at 0.92 and 10.5 ms, too coarse for a quantile); and the
	// goroutine-seconds blocked on mutexes (the runtime's own locks too).
	NodeGCCPUShare       float64 `json:"node_gc_cpu_share"`
	NodeRunnableOver1MS  float64 `json:"node_runnable_over_1ms_share"`
	NodeRunnableOver10MS float64 `json:"node_runnable_over_10ms_share"`
	NodeRunnableSamples  uint64  `json:"node_runnable_samples"`
	NodeMutexWaitSeconds float64 `json:"node_mutex_wait_seconds"`
}

// externalLatencyFractions are the out-of-process run's paced rates, as
// fractions of its store-heavy run's events/s.
var externalLatencyFractions = []float64{0.25, 0.5}

// externalLevelMinEvents keeps a short run's level big enough to see jobs.
const externalLevelMinEvents = 2_000

// externalLatencyWorkload is the store-heavy mix with no shared prefixes:
// every ready chunk is stored (nothing deduplicates), so every job comes
// back as a stored message to be timed, as in the latency phase.
func externalLatencyWorkload() workload {
	w := storeHeavyWorkload()
	w.shared = 0
	return w
}

// externalLatency paces the store-heavy mix (shared = 0) through the child
// at each fraction of capacity (the store-heavy run's events/s), on fresh
// engines per level.
func externalLatency(ctx context.Context, cfg Config, c *child, r *rig, capacity float64) ([]ExternalLatencyLevel, error) {
	var levels []ExternalLatencyLevel
	for k, f := range externalLatencyFractions {
		lvl, err := externalLevel(ctx, cfg, c, r, k, f, capacity*f)
		if err != nil {
			return nil, fmt.Errorf("latency at %.0f%%: %w", f*100, err)
		}
		levels = append(levels, *lvl)
		progress(cfg, "external latency at %.0f%% (%.0f events/s): client p99 %.3f ms, node p99 %.3f ms (intake wait p99 %.3f, queue wait p99 %.3f, to stored p99 %.3f), %d jobs, node %.2f µs CPU/event, %.2f switches/event, %.2f syscalls/event, %s, bench CPU-s %.2f",
			f*100, lvl.AchievedPerSec, lvl.ClientP99MS, lvl.NodeP99MS, lvl.NodeIntakeWaitP99MS, lvl.NodeQueueWaitP99MS, lvl.NodeStoredP99MS, lvl.Jobs, lvl.NodeUSPerEvent,
			lvl.NodeSwitchesPerEvent, lvl.NodeSyscallsPerEvent, lvl.runtimeTail(), lvl.BenchCPUSeconds)
	}
	return levels, nil
}

// externalTraceFraction is the level Config.ExternalTrace traces: the one
// issue 14's p99 goal is set at.
const externalTraceFraction = 0.5

// externalLevel is latencyLevel against the child: engines "l<percent>e<i>"
// register on it, their batches are pre-encoded and paced at rate events/s,
// client latency comes from their stored messages, node latency from the
// child's kvactors_store_decision_seconds scraped before and after.
func externalLevel(ctx context.Context, cfg Config, c *child, r *rig, k int, fraction, rate float64) (*ExternalLatencyLevel, error) {
	tag := fmt.Sprintf("l%.0f", fraction*100)
	base := engineIDs(cfg.Engines)
	ids := make([]string, len(base))
	gens := make([]*engineGen, len(base))
	for i, id := range base {
		ids[i] = tag + id
		// Seeds of their own: the child's pool still holds earlier runs'
		// chunks, and a hash met before would deduplicate, not store.
		gens[i] = newEngineGen(ids[i], tag, uint64(i+1)*0x9e37+uint64(k+1)<<48, storeGeometry(), externalLatencyWorkload())
		gens[i].trigger = triggers{}
	}
	events := max(externalLevelMinEvents, min(maxEvents, int(rate*cfg.Duration.Seconds())))
	perEngine := fill(gens, events)

	var s sampler
	published := make([][]atomic.Int64, len(ids))
	streams := make([]stream, len(ids))
	conns := make([]*nats.Conn, len(ids))
	for i, id := range ids {
		nc, _, err := r.engine(ctx, id, storeGeometry())
		if err != nil {
			return nil, err
		}
		conns[i] = nc
		published[i] = make([]atomic.Int64, len(perEngine[i]))
		g, pub := gens[i], published[i]
		sub, err := nc.Subscribe(r.subject(id, "stored"), func(m *nats.Msg) { s.onStored(g, pub, m) })
		if err != nil {
			return nil, err
		}
		if err := sub.SetPendingLimits(-1, -1); err != nil {
			return nil, err
		}
		if err := flush(ctx, nc); err != nil {
			return nil, err
		}
		streams[i] = stream{nc: nc, subject: r.subject(id, "events"), batches: perEngine[i]}
	}
	total, applied := 0, 0
	events = 0
	for _, st := range streams {
		total += len(st.batches)
		for _, b := range st.batches {
			events += int(b.events)
			applied += int(b.applied)
		}
	}
	batchRate := rate / (float64(events) / float64(total))

	metrics := "http://" + c.httpAddr + "/metrics"
	before, err := scrape(ctx, metrics)
	if err != nil {
		return nil, err
	}
	appliedBase, rejectedBase := gatherSum(before, mApplied, "", ""), gatherSum(before, mRejected, "", "")
	cpu0, err := c.cpuSeconds()
	if err != nil {
		return nil, err
	}
	bench0 := cpuSeconds()
	pc0, err := readProcCounters(c.cmd.Process.Pid)
	if err != nil {
		return nil, err
	}
	// The trace spans the pacing (so the level's CPU and switch figures
	// include the tracer's cost, and starting it stops the world briefly).
	var traceTo, profileTo io.Writer // nil: startFetch does nothing
	if fraction == externalTraceFraction {
		traceTo, profileTo = cfg.ExternalTrace, cfg.ExternalLevelProfile
	}
	span := float64(events) / rate
	trace := startFetch(ctx, c, "trace", fmt.Sprintf("/debug/pprof/trace?seconds=%g", span), traceTo)
	// The profile takes whole seconds; the part past the pacing is idle
	// and adds no samples.
	profile := startFetch(ctx, c, "level profile", fmt.Sprintf("/debug/pprof/profile?seconds=%d", int(math.Ceil(span))), profileTo)
	start, last, err := pace(ctx, streams, published, batchRate)
	for _, f := range []*fetch{trace, profile} {
		if ferr := f.wait(); err == nil {
			err = ferr
		}
	}
	if err != nil {
		return nil, err
	}
	// Every event applied (scraped every 2 ms; the other engines are idle),
	// then stored messages trail the last batch by a copy: wait until none
	// has arrived for 50 ms.
	var scrapeErr error
	if err := c.await(ctx, fmt.Sprintf("the child to apply %d events", applied), 30*time.Second, func() bool {
		g, err := scrape(ctx, metrics)
		if scrapeErr = err; err != nil {
			return true
		}
		return gatherSum(g, mApplied, "", "")-appliedBase >= float64(applied)
	}); err != nil {
		return nil, err
	}
	if scrapeErr != nil {
		return nil, scrapeErr
	}
	_ = waitFor(ctx, "stored messages to stop arriving", 5*time.Second, func() bool {
		return time.Since(time.Unix(0, s.last.Load())) > 50*time.Millisecond
	})
	for _, nc := range conns {
		_ = nc.Drain() // delivers what the subscriptions still hold
	}
	_ = waitFor(ctx, "engine connections to drain", 5*time.Second, func() bool {
		for _, nc := range conns {
			if !nc.IsClosed() {
				return false
			}
		}
		return true
	})
	cpu1, err := c.cpuSeconds()
	if err != nil {
		return nil, err
	}
	bench1 := cpuSeconds()
	pc1, err := readProcCounters(c.cmd.Process.Pid)
	if err != nil {
		return nil, err
	}
	pc := pc1.minus(pc0)
	after, err := scrape(ctx, metrics)
	if err != nil {
		return nil, err
	}
	w := window{before, after}
	node, wait, stored, intake := w.hist(mDecision), w.hist(mQueueWait), w.hist(mStoredTime), w.hist(mIntakeWait)

	s.mu.Lock()
	defer s.mu.Unlock()
	slices.Sort(s.samples)
	lvl := &ExternalLatencyLevel{LatencyLevel: LatencyLevel{Fraction: fraction, TargetPerSec: rate, Events: events,
		Jobs: len(s.samples), Unmatched: s.unmatched, NodeJobs: node.count(),
		RejectedOrFailed: gatherSum(after, mRejected, "", "") - rejectedBase},
		NodeCPUSeconds: cpu1 - cpu0, NodeUSPerEvent: (cpu1 - cpu0) * 1e6 / float64(events), BenchCPUSeconds: bench1 - bench0,
		GCCycles:             int(w.sum(mGCPauses)),
		NodeSwitchesPerEvent: float64(pc.Switches) / float64(events), NodeSyscallsPerEvent: float64(pc.Syscalls) / float64(events)}
	if secs := last.Sub(start).Seconds(); secs > 0 {
		lvl.AchievedPerSec = float64(events) / secs
	}
	lvl.ClientP50MS, lvl.ClientP99MS, lvl.ClientP999MS = pct(s.samples, 0.5), pct(s.samples, 0.99), pct(s.samples, 0.999)
	lvl.NodeP50MS, lvl.NodeP99MS, lvl.NodeP999MS = node.quantile(0.5)*1e3, node.quantile(0.99)*1e3, node.quantile(0.999)*1e3
	lvl.NodeQueueWaitP50MS, lvl.NodeQueueWaitP99MS = wait.quantile(0.5)*1e3, wait.quantile(0.99)*1e3
	lvl.NodeStoredP50MS, lvl.NodeStoredP99MS = stored.quantile(0.5)*1e3, stored.quantile(0.99)*1e3
	lvl.NodeIntakeWaitP50MS, lvl.NodeIntakeWaitP99MS = intake.quantile(0.5)*1e3, intake.quantile(0.99)*1e3
	lvl.readRuntime(w)
	return lvl, nil
}

// window is the child's metrics before and after a level.
type window struct{ before, after prometheus.Gatherer }

// hist is name's observations during the window.
func (w window) hist(name string) histogram {
	return snapshot(w.after, name).minus(snapshot(w.before, name))
}

// sum is how much name's counter (or histogram or summary count) grew
// during the window.
func (w window) sum(name string) float64 {
	return gatherSum(w.after, name, "", "") - gatherSum(w.before, name, "", "")
}

// readRuntime sets the level's runtime figures from the window (all zero
// against a node that does not export them).
func (l *ExternalLatencyLevel) readRuntime(w window) {
	runnable := w.hist(mSchedLatency)
	l.NodeRunnableOver1MS, l.NodeRunnableOver10MS = runnable.overNear(1e-3), runnable.overNear(10e-3)
	l.NodeRunnableSamples = runnable.count()
	l.NodeMutexWaitSeconds = w.sum(mMutexWait)
	l.NodeGCCPUShare = 0
	if busy := w.sum(mCPUTotal) - w.sum(mCPUIdle); busy > 0 {
		l.NodeGCCPUShare = w.sum(mGCCPU) / busy
	}
}

// runtimeTail is the level's runtime figures as one line's part.
func (l *ExternalLatencyLevel) runtimeTail() string {
	return fmt.Sprintf("GC %.0f%% of its busy CPU, goroutines runnable > 1 ms %.2f%% and > 10 ms %.3f%% of %d sampled wake-ups, mutex wait %.3f s",
		l.NodeGCCPUShare*100, l.NodeRunnableOver1MS*100, l.NodeRunnableOver10MS*100, l.NodeRunnableSamples, l.NodeMutexWaitSeconds)
}
