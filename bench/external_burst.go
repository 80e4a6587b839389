package bench

import (
	"context"
	"encoding/binary"
	"fmt"
	"io"
	"log/slog"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvactors/kvactors/backend/shm"
	"github.com/kvactors/kvactors/client"
	"github.com/kvactors/kvactors/messages"
)

// ExternalBurst is issue 14's bounded-memory check out of process: Requests
// requests published as fast as the engines can, against a fresh
// `kvactors serve` child. The engines are the Go SDK (package client), so
// a batch the node's intake drops past its budget comes back as a resync
// that re-announces the engine's live requests, as a real engine does.
// Every request asks for its chunks to be stored (no shared prefixes) and
// finishes at once, so the node must copy all of them before releasing it.
type ExternalBurst struct {
	Requests    int   `json:"requests"`
	Engines     int   `json:"engines"`
	Events      int   `json:"events"`
	PoolBytes   int64 `json:"pool_bytes"`
	BudgetBytes int64 `json:"max_pending_bytes"` // the child's --max-pending-bytes (0: its default)
	// PublishSeconds is how long the engines took to publish the burst;
	// Seconds runs from the first publish to the last release.
	PublishSeconds float64 `json:"publish_seconds"`
	Seconds        float64 `json:"seconds"`
	NodeCPUSeconds float64 `json:"node_cpu_seconds"`
	// Released counts releases delivered by the SDK (each request owes
	// one); Unexpected counts releases the SDK found for no waiting
	// request (must be 0).
	Released   int `json:"released"`
	Unexpected int `json:"unexpected_releases"`
	// Resyncs are the engines' (the SDK's Stats, by reason), Overflow the
	// node's kvactors_resyncs_total{reason="overflow"}.
	Resyncs  map[string]int `json:"engine_resyncs"`
	Overflow float64        `json:"node_overflow_resyncs"`
	Jobs     int            `json:"store_jobs"`
	Chunks   int            `json:"stored_chunks"`
	// Unstored counts requests that never got a stored message (all their
	// chunks dropped, or a stored message lost): 0 in a healthy run.
	Unstored int `json:"requests_never_stored"`
	// Store delay: each request's publish (the Flush of its batch) → its
	// first stored message at its engine, over the requests that had one.
	DelayP50MS float64 `json:"store_delay_p50_ms"`
	DelayP99MS float64 `json:"store_delay_p99_ms"`
	DelayMaxMS float64 `json:"store_delay_max_ms"`
	// NodeMaxRSSBytes is the child's VmHWM: everything resident, including
	// the pages of the engines' segments it copied from (the engines'
	// memory, mapped; device memory with CUDA). NodePeakAnonBytes is the
	// highest RssAnon sampled every 5 ms (heap, stacks: what the node
	// itself allocates), which with the pool is what the goal bounds.
	NodeMaxRSSBytes   int64 `json:"node_max_rss_bytes"`
	NodePeakAnonBytes int64 `json:"node_peak_anon_bytes"`
	// NodePeakGoroutines and PeakRetriesPending are the highest
	// go_goroutines and kvactors_store_retries_pending of the child's
	// /metrics, scraped every 100 ms: goroutines must not grow with the
	// requests waiting for room (a retry per goroutine once held 66,000).
	NodePeakGoroutines float64 `json:"node_peak_goroutines"`
	PeakRetriesPending float64 `json:"peak_retries_pending"`
}

// burstBatchRequests is how many requests' events one engine Flush carries
// (~6 events each): batches of a few KiB, as an engine step would send.
const burstBatchRequests = 64

// burstPromptTokens is each request's prompt: 4 blocks of 16 tokens, one
// chunk per block and group (storeGeometry), so 8 chunks to store.
const burstPromptTokens = 64

// burstEngine is one SDK engine of the burst and what came back to it.
type burstEngine struct {
	id  string
	c   *client.Client
	nc  *nats.Conn // the SDK does not close it
	geo geometry

	mu        sync.Mutex
	published map[string]time.Time // request → the Flush that carried it
	delays    []time.Duration
	jobs      int
	chunks    int
	released  int
	lastStore time.Time
}

func (e *burstEngine) onStored(s messages.Stored) {
	now := time.Now()
	e.mu.Lock()
	defer e.mu.Unlock()
	e.jobs++
	e.chunks += len(s.Chunks)
	e.lastStore = now
	if t, ok := e.published[s.Request]; ok {
		e.delays = append(e.delays, now.Sub(t))
		delete(e.published, s.Request) // the first stored message only
	}
}

func (e *burstEngine) onReleased(client.Release) {
	e.mu.Lock()
	e.released++
	e.mu.Unlock()
}

// runExternalBurst starts its own child (its peak RSS is the burst's alone),
// connects cfg.Engines SDK engines and publishes cfg.ExternalBurst
// requests split between them, then waits for every release.
func runExternalBurst(ctx context.Context, cfg Config) (*ExternalBurst, error) {
	var extra []string
	if cfg.ExternalBurstBudget > 0 {
		extra = append(extra, "--max-pending-bytes", strconv.FormatInt(cfg.ExternalBurstBudget, 10))
	}
	prefix := randomPrefix("kvbenchb_")
	c, err := startChild(ctx, cfg, prefix, extra...)
	if err != nil {
		return nil, err
	}
	defer c.stop()
	perEngine := (cfg.ExternalBurst + cfg.Engines - 1) / cfg.Engines
	geo := storeGeometry()
	// No two live requests share a block; id 0 is the null block (never stored).
	geo.numBlocks = perEngine*burstPromptTokens/geo.tpb + 1
	res := &ExternalBurst{Requests: cfg.ExternalBurst, Engines: cfg.Engines, PoolBytes: eventPoolBytes,
		BudgetBytes: cfg.ExternalBurstBudget, Resyncs: map[string]int{}}

	var engines []*burstEngine
	defer func() {
		for _, e := range engines {
			_ = e.c.Close()
			e.nc.Close()
		}
	}()
	var segs []*shm.Segment
	defer func() {
		for _, s := range segs {
			_ = s.Remove()
		}
	}()
	quiet := slog.New(slog.NewTextHandler(io.Discard, nil))
	for i, id := range engineIDs(cfg.Engines) {
		id = "b" + id
		seg, err := shm.Create(cfg.ShmDir, id+"-"+prefix, geo.segmentBytes())
		if err != nil {
			return nil, err
		}
		segs = append(segs, seg)
		mem := seg.Bytes()
		for j := range mem { // resident, as a GPU's memory is
			mem[j] = byte(j*7 + i)
		}
		nc, err := client.Dial(c.natsURL, id)
		if err != nil {
			return nil, fmt.Errorf("connect %s: %w", id, err)
		}
		e := &burstEngine{id: id, nc: nc, geo: geo, published: map[string]time.Time{}}
		cl, err := client.Connect(ctx, nc, client.Config{Engine: id, Prefix: prefix, Spec: geo.spec(seg.Name()),
			Log: quiet, OnStored: e.onStored, OnReleased: e.onReleased})
		if err != nil {
			nc.Close()
			return nil, fmt.Errorf("register %s: %w", id, err)
		}
		e.c = cl
		engines = append(engines, e)
	}

	metrics := "http://" + c.httpAddr + "/metrics"
	before, err := scrape(ctx, metrics)
	if err != nil {
		return nil, err
	}
	cpu0, err := c.cpuSeconds()
	if err != nil {
		return nil, err
	}
	start := time.Now()
	sampled := make(chan int64)
	stopSampling := make(chan struct{})
	go func() { // the peak of RssAnon until the last release
		var peak int64
		t := time.NewTicker(5 * time.Millisecond)
		defer t.Stop()
		for {
			peak = max(peak, c.memory().Anon)
			select {
			case <-stopSampling:
				sampled <- peak
				return
			case <-t.C:
			}
		}
	}()
	peaks := make(chan [2]float64)
	go func() { // the peaks of goroutines and pending retries, from /metrics
		var p [2]float64
		t := time.NewTicker(100 * time.Millisecond)
		defer t.Stop()
		for {
			if g, err := scrape(ctx, metrics); err == nil {
				p[0] = max(p[0], gatherSum(g, mGoroutines, "", ""))
				p[1] = max(p[1], gatherSum(g, mPending, "", ""))
			}
			select {
			case <-stopSampling:
				peaks <- p
				return
			case <-t.C:
			}
		}
	}()
	defer func() {
		if stopSampling != nil {
			close(stopSampling)
			<-sampled
			<-peaks
		}
	}()
	var wg sync.WaitGroup
	errs := make([]error, len(engines))
	events := make([]int, len(engines))
	for i, e := range engines {
		n := min(perEngine, cfg.ExternalBurst-i*perEngine)
		wg.Add(1)
		go func() {
			defer wg.Done()
			events[i], errs[i] = e.publish(ctx, i, n)
		}()
	}
	wg.Wait()
	res.PublishSeconds = time.Since(start).Seconds()
	for i, err := range errs {
		if err != nil {
			return nil, fmt.Errorf("engine %s: %w", engines[i].id, err)
		}
		res.Events += events[i]
	}
	progress(cfg, "external burst: %d requests (%d events) published in %.2fs", cfg.ExternalBurst, res.Events, res.PublishSeconds)

	released := func() int {
		n := 0
		for _, e := range engines {
			e.mu.Lock()
			n += e.released
			e.mu.Unlock()
		}
		return n
	}
	if err := c.await(ctx, "every request of the burst to be released", 5*time.Minute, func() bool {
		return released() >= cfg.ExternalBurst
	}); err != nil {
		return nil, fmt.Errorf("%w (%d of %d released)", err, released(), cfg.ExternalBurst)
	}
	res.Seconds = time.Since(start).Seconds()
	// stored and released are separate subscriptions: a request's last
	// stored can be handed to the SDK's callbacks after its release. Wait
	// until every request has had one, or none came for 200 ms (a request
	// whose chunks were all dropped has none).
	if err := c.await(ctx, "the last stored messages", 10*time.Second, func() bool {
		waiting, quiet := 0, true
		for _, e := range engines {
			e.mu.Lock()
			waiting += len(e.published)
			quiet = quiet && time.Since(e.lastStore) > 200*time.Millisecond
			e.mu.Unlock()
		}
		return waiting == 0 || quiet
	}); err != nil {
		return nil, err
	}
	cpu1, err := c.cpuSeconds()
	if err != nil {
		return nil, err
	}
	res.NodeCPUSeconds = cpu1 - cpu0
	res.NodeMaxRSSBytes = c.maxRSS()
	close(stopSampling)
	res.NodePeakAnonBytes = <-sampled
	p := <-peaks
	res.NodePeakGoroutines, res.PeakRetriesPending, stopSampling = p[0], p[1], nil
	after, err := scrape(ctx, metrics)
	if err != nil {
		return nil, err
	}
	res.Overflow = gatherSum(after, "kvactors_resyncs_total", "reason", "overflow") -
		gatherSum(before, "kvactors_resyncs_total", "reason", "overflow")
	var delays []time.Duration
	for _, e := range engines {
		st := e.c.Stats()
		res.Unexpected += st.UnexpectedRel
		for k, v := range st.Resyncs {
			res.Resyncs[k] += v
		}
		e.mu.Lock()
		res.Released += e.released
		res.Jobs += e.jobs
		res.Chunks += e.chunks
		res.Unstored += len(e.published)
		delays = append(delays, e.delays...)
		e.mu.Unlock()
	}
	slices.Sort(delays)
	if len(delays) > 0 {
		res.DelayP50MS, res.DelayP99MS = pct(delays, 0.5), pct(delays, 0.99)
		res.DelayMaxMS = float64(delays[len(delays)-1]) / 1e6
	}
	return res, nil
}

// publish sends n requests of engine k in batches of burstBatchRequests:
// each is added, hashed (unique hashes: nothing deduplicates), given its
// blocks in both groups, computed and finished. It returns the events sent;
// ctx's end stops it between batches.
func (e *burstEngine) publish(ctx context.Context, k, n int) (int, error) {
	hashes := burstPromptTokens / e.geo.tph
	blocks := burstPromptTokens / e.geo.tpb
	ids := make([]uint32, blocks)
	hs := make([][]byte, hashes)
	events := 0
	for first := 0; first < n; first += burstBatchRequests {
		if err := ctx.Err(); err != nil {
			return events, err
		}
		last := min(n, first+burstBatchRequests)
		reqs := make([]string, 0, last-first)
		for r := first; r < last; r++ {
			req := e.id + "-" + strconv.Itoa(r)
			reqs = append(reqs, req)
			e.c.Added(req, burstPromptTokens)
			for h := range hs {
				hs[h] = binary.BigEndian.AppendUint64(binary.BigEndian.AppendUint64(make([]byte, 0, 16), uint64(k)<<32|uint64(r)), uint64(h))
			}
			e.c.Hashes(req, 0, hs...)
			for g := range e.geo.groups() {
				for b := range ids {
					ids[b] = uint32(r*blocks + b + 1)
				}
				e.c.Blocks(req, g, 0, ids)
			}
			e.c.Tokens(req, burstPromptTokens, burstPromptTokens)
			e.c.Finished(req, false, burstPromptTokens, burstPromptTokens)
			events += 4 + e.geo.groups()
		}
		now := time.Now()
		e.mu.Lock()
		for _, req := range reqs {
			e.published[req] = now
		}
		e.mu.Unlock()
		if err := e.c.Flush(); err != nil {
			return events, fmt.Errorf("flush: %w", err)
		}
	}
	return events, nil
}
