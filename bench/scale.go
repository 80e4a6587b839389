package bench

import (
	"context"
	"fmt"
	"runtime"
	"runtime/debug"
)

// Scale is the scale phase's result: memory per live request, and decode
// throughput with Base and with Requests requests live.
type Scale struct {
	Requests int `json:"requests"`
	Base     int `json:"base"`
	// HeapBytesPerRequest is the Go heap in use (runtime.MemStats.HeapAlloc
	// after a GC) gained while Requests-Base more requests went live,
	// divided by them; RSSBytesPerRequest the same with /proc/self/statm.
	HeapBytesPerRequest float64 `json:"heap_bytes_per_request"`
	RSSBytesPerRequest  float64 `json:"rss_bytes_per_request"`
	SetupSeconds        float64 `json:"setup_seconds"`
	BaseEventsPerSec    float64 `json:"base_events_per_sec"`
	EventsPerSec        float64 `json:"events_per_sec"`
	Ratio               float64 `json:"ratio"`
	BaseEventsPerCPUSec float64 `json:"base_events_per_cpu_sec"`
	EventsPerCPUSec     float64 `json:"events_per_cpu_sec"`
	CPURatio            float64 `json:"cpu_ratio"`
	LiveAtEnd           float64 `json:"live_at_end"`
	Rejected            float64 `json:"rejected"`
}

func runScale(ctx context.Context, cfg Config) (*Scale, error) {
	ids := engineIDs(cfg.Engines)
	gens := newGens("s", ids, mixedWorkload(), false)
	r, conns, err := startEventRig(ctx, cfg, ids)
	if err != nil {
		return nil, err
	}
	defer r.close()
	sink := r.nodeSink(ids, conns)
	seed := func(n int) [][]batch {
		out := make([][]batch, len(gens))
		for i, g := range gens {
			out[i] = g.live(share(n, len(gens), i))
		}
		return out
	}
	decode := func() [][]batch { return fill(gens, chunkEvents(cfg.Duration)) }
	res := &Scale{Requests: cfg.ScaleRequests, Base: cfg.ScaleBase}

	if _, err := load(ctx, cfg, sink, seed(cfg.ScaleBase)); err != nil {
		return nil, err
	}
	base, err := measure(ctx, cfg, sink, decode, cfg.Duration)
	if err != nil {
		return nil, err
	}
	res.BaseEventsPerSec, res.BaseEventsPerCPUSec = base.perSec(), base.perCPUSec()
	progress(cfg, "scale: %d live: %.0f events/s", cfg.ScaleBase, res.BaseEventsPerSec)

	rest := seed(cfg.ScaleRequests - cfg.ScaleBase) // encoded before the first reading
	heap0, rss0 := settledMemory()
	seeded, err := load(ctx, cfg, sink, rest)
	if err != nil {
		return nil, err
	}
	res.SetupSeconds = seeded.secs
	heap1, rss1 := settledMemory()
	runtime.KeepAlive(rest) // allocated across both readings: not counted
	added := float64(cfg.ScaleRequests - cfg.ScaleBase)
	res.HeapBytesPerRequest = float64(int64(heap1)-int64(heap0)) / added
	res.RSSBytesPerRequest = float64(rss1-rss0) / added

	all, err := measure(ctx, cfg, sink, decode, cfg.Duration)
	if err != nil {
		return nil, err
	}
	res.EventsPerSec, res.EventsPerCPUSec = all.perSec(), all.perCPUSec()
	res.Ratio = res.EventsPerSec / res.BaseEventsPerSec
	res.CPURatio = res.EventsPerCPUSec / res.BaseEventsPerCPUSec
	res.LiveAtEnd = gatherSum(r.reg, mReqsLive, "", "")
	res.Rejected = gatherSum(r.reg, mRejected, "", "")
	progress(cfg, "scale: %d live: %.0f events/s, %.0f heap bytes per request",
		cfg.ScaleRequests, res.EventsPerSec, res.HeapBytesPerRequest)
	return res, nil
}

// share is engine i's part of n requests.
func share(n, engines, i int) int {
	s := n / engines
	if i < n%engines {
		s++
	}
	return s
}

// load publishes batches once, flow-controlled, and waits until the node
// applied them all.
func load(ctx context.Context, cfg Config, s sink, batches [][]batch) (tally, error) {
	done := false
	t, err := measure(ctx, cfg, s, func() [][]batch {
		if done {
			return nil
		}
		done = true
		return batches
	}, 0)
	if err != nil {
		return tally{}, fmt.Errorf("load batches: %w", err)
	}
	return t, nil
}

// settledMemory is the live heap and the RSS after two collections and
// returning freed memory to the OS.
func settledMemory() (heap uint64, rss int64) {
	runtime.GC()
	debug.FreeOSMemory()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return ms.HeapAlloc, residentBytes()
}
