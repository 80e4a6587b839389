package bench

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"math"
	"net/http"
	"strings"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvactors/kvactors/ingest"
)

// External is the out-of-process run's result (issue 14): a separate
// `kvactors serve` process, engines on real NATS connections, the clock
// stopped when the last `released` of a chunk's finished requests arrived.
// Node CPU is the child's user + system time (/proc/<pid>/stat) over the
// same intervals, so it holds everything the node process does: its
// embedded NATS server, decoding, actors, copies and outgoing messages.
type External struct {
	Workload       string  `json:"workload"`
	Engines        int     `json:"engines"`
	Events         int     `json:"events"`
	Batches        int     `json:"batches"`
	Finishes       int     `json:"finished_events"`
	Requests       int     `json:"requests_released"`
	EventsPerReq   float64 `json:"events_per_request"`
	StoreJobs      int     `json:"store_jobs"`
	StoredChunks   int     `json:"stored_chunks"`
	Seconds        float64 `json:"seconds"`
	EventsPerSec   float64 `json:"events_per_sec"`
	NodeCPUSeconds float64 `json:"node_cpu_seconds"`
	// NodeUSPer* divide the node's whole CPU time by one count each: they
	// are not a split of the CPU between events, chunks and jobs.
	NodeUSPerEvent float64 `json:"node_us_per_event"`
	NodeUSPerChunk float64 `json:"node_us_per_stored_chunk"`
	NodeUSPerJob   float64 `json:"node_us_per_store_job"`
	// BenchCPUSeconds is this process's CPU over the node run (publishing
	// engines and the released/stored subscribers).
	BenchCPUSeconds float64 `json:"bench_cpu_seconds"`
	// Raw* is the baseline in the same run: the same bodies through the
	// child's NATS server to a plain subscriber here that parses the subject
	// and calls ingest.DecodeBatch. RawNodeCPUSeconds is the child's CPU
	// meanwhile (its NATS server routing only).
	RawEvents         int     `json:"raw_events"`
	RawSeconds        float64 `json:"raw_seconds"`
	RawEventsPerSec   float64 `json:"raw_events_per_sec"`
	RawNodeCPUSeconds float64 `json:"raw_node_cpu_seconds"`
	RawNodeUSPerEvent float64 `json:"raw_node_us_per_event"`
	Ratio             float64 `json:"ratio"`
	// NoStore* is the same mix without hashes on other engines of the same
	// child, after the store-heavy run: nothing becomes ready, nothing is
	// stored. StoreUSPerChunk is the store-heavy run's node CPU less its
	// events at the no-store cost, per stored chunk: what storing adds
	// (its jobs, copies, stored and kv_events messages and evictions).
	NoStoreEvents     int     `json:"nostore_events"`
	NoStoreSeconds    float64 `json:"nostore_seconds"`
	NoStoreCPUSeconds float64 `json:"nostore_node_cpu_seconds"`
	NoStoreUSPerEvent float64 `json:"nostore_node_us_per_event"`
	StoreUSPerChunk   float64 `json:"store_node_us_per_stored_chunk"`
	// Narrow* is the store-heavy mix again on engines of their own, with
	// one block per prefill step, so its jobs hold fewer chunks (about 2,
	// against about 5). Unit* splits what storing adds between chunks and
	// jobs from the two mixes (unitCosts): issue 14's per-unit goals.
	NarrowEvents       int     `json:"narrow_events"`
	NarrowStoreJobs    int     `json:"narrow_store_jobs"`
	NarrowStoredChunks int     `json:"narrow_stored_chunks"`
	NarrowSeconds      float64 `json:"narrow_seconds"`
	NarrowCPUSeconds   float64 `json:"narrow_node_cpu_seconds"`
	UnitUSPerChunk     float64 `json:"unit_us_per_stored_chunk"`
	UnitUSPerJob       float64 `json:"unit_us_per_store_job"`
	// NodeMaxRSSBytes is the child's peak resident set (VmHWM) at the end
	// of the no-store run.
	NodeMaxRSSBytes int64 `json:"node_max_rss_bytes"`
	// NodeProcs is the child's GOMAXPROCS, as its /metrics reports it
	// (Config.ExternalProcs sets it; 0: not read).
	NodeProcs int `json:"node_procs"`
	// Latency is paced runs through the same child after the no-store run
	// (external_latency.go), at fractions of LatencyBasePerSec (EventsPerSec
	// unless Config.ExternalRate set it): the store-heavy mix with no shared
	// prefixes, on fresh engines per level. Node* is the child's
	// kvactors_store_decision_seconds scraped from its /metrics.
	LatencyWorkload   string                 `json:"latency_workload"`
	LatencyBasePerSec float64                `json:"latency_base_events_per_sec"`
	Latency           []ExternalLatencyLevel `json:"latency_levels"`
}

// storeHeavyWorkload is issue 14's mix: about 22 events per request, one
// 256-byte block per chunk (storeGeometry), two groups; short prompts and
// short decodes so most events complete a chunk.
func storeHeavyWorkload() workload {
	return workload{promptMin: 64, promptMax: 192, outputMin: 0, outputMax: 24, prefillChunk: 64,
		running: 32, queuedAbort: 0.03, midAbort: 0.05, shared: 0.25, families: 8, sharedHashes: 4}
}

// narrowWorkload is storeHeavyWorkload prefilled one block (16 tokens) per
// step: the same requests in more, smaller steps, so each store job holds
// about one chunk per group.
func narrowWorkload() workload {
	w := storeHeavyWorkload()
	w.prefillChunk = storeGeometry().tokensPerChunk()
	return w
}

// storeGeometry is eventGeometry with one block per chunk: every 16 tokens
// complete one chunk per group.
func storeGeometry() geometry {
	g := eventGeometry()
	g.bpc = 1
	return g
}

// externalChunkEvents bounds one timed chunk so that everything published
// ahead of the node (about 14 MB at 100,000 events) fits the child's default
// inbound budget (--max-pending-bytes 256 MiB, a quarter of it for nats.go).
func externalChunkEvents(d time.Duration) int {
	return max(2_000, min(100_000, int(d.Seconds()*100_000)))
}

// outcome counts what the node sent back to each mix's engines, told apart
// by the engine id's first letter (noStorePrefix, narrowPrefix, else the
// store-heavy mix's).
type outcome struct {
	prefix                 string // P of P.<engine>.<verb> (observe)
	heavy, noStore, narrow replies
}

// replies counts one mix's releases, stored messages (jobs) and chunks stored.
type replies struct {
	released, jobs, chunks atomic.Int64
}

// noStorePrefix starts the no-store engines' ids, narrowPrefix the narrow
// mix's.
const (
	noStorePrefix = "n"
	narrowPrefix  = "w"
)

// of is the counts of the mix of the engine in subject P.<engine>.<verb>
// (the node only publishes well-formed ones: any other counts as the
// store-heavy mix's, whose checks then fail).
func (o *outcome) of(subject string) *replies {
	engine, _, _ := ingest.ParseSubject(o.prefix, subject)
	switch {
	case strings.HasPrefix(engine, noStorePrefix):
		return &o.noStore
	case strings.HasPrefix(engine, narrowPrefix):
		return &o.narrow
	}
	return &o.heavy
}

// observe subscribes to every engine's released and stored subjects.
func (o *outcome) observe(ctx context.Context, nc *nats.Conn, prefix string) error {
	o.prefix = prefix
	for verb, f := range map[string]func(*nats.Msg){
		"released": func(m *nats.Msg) { o.of(m.Subject).released.Add(1) },
		"stored": func(m *nats.Msg) {
			t := o.of(m.Subject)
			t.jobs.Add(1)
			t.chunks.Add(int64(bytes.Count(m.Data, []byte(`"key"`))))
		},
	} {
		s, err := nc.Subscribe(prefix+".*."+verb, f)
		if err != nil {
			return fmt.Errorf("subscribe %s: %w", verb, err)
		}
		if err := s.SetPendingLimits(-1, -1); err != nil {
			return err
		}
	}
	return flush(ctx, nc)
}

func runExternal(ctx context.Context, cfg Config) (*External, error) {
	prefix := randomPrefix("kvbenchx_")
	c, err := startChild(ctx, cfg, prefix)
	if err != nil {
		return nil, err
	}
	defer c.stop()
	r := &rig{cfg: cfg, prefix: prefix, url: c.natsURL}
	defer r.close()
	ids := engineIDs(cfg.Engines)
	conns := make([]*nats.Conn, len(ids))
	for i, id := range ids {
		if conns[i], _, err = r.engine(ctx, id, storeGeometry()); err != nil {
			return nil, err
		}
	}
	res := &External{Workload: "store-heavy", Engines: cfg.Engines}
	gens := func(ids []string, tag string, w workload) func() [][]batch {
		gens := make([]*engineGen, len(ids))
		for i, id := range ids {
			gens[i] = newEngineGen(id, tag, uint64(i+1)*0x9e37, storeGeometry(), w)
		}
		return func() [][]batch { return fill(gens, externalChunkEvents(cfg.Duration)) }
	}
	storeHeavy := func() func() [][]batch { return gens(ids, "x", storeHeavyWorkload()) }

	// The raw baseline first, on the child's server (the node does not
	// subscribe to its subjects).
	var raw Throughput
	cpu0, err := c.cpuSeconds()
	if err != nil {
		return nil, err
	}
	if err := rawBaseline(ctx, cfg, r, ids, storeHeavy(), &raw); err != nil {
		return nil, err
	}
	cpu1, err := c.cpuSeconds()
	if err != nil {
		return nil, err
	}
	res.RawEvents, res.RawSeconds, res.RawEventsPerSec = raw.RawEvents, raw.RawSeconds, raw.RawEventsPerSec
	res.RawNodeCPUSeconds = cpu1 - cpu0

	// The other mixes' engines register now, before anything is timed.
	register := func(tag string) ([]string, []*nats.Conn, error) {
		mids, mconns := make([]string, len(ids)), make([]*nats.Conn, len(ids))
		for i := range ids {
			mids[i] = tag + ids[i]
			nc, _, err := r.engine(ctx, mids[i], storeGeometry())
			if err != nil {
				return nil, nil, err
			}
			mconns[i] = nc
		}
		return mids, mconns, nil
	}
	noIDs, noConns, err := register(noStorePrefix)
	if err != nil {
		return nil, err
	}
	narrowIDs, narrowConns, err := register(narrowPrefix)
	if err != nil {
		return nil, err
	}
	obs, err := r.connect("observer")
	if err != nil {
		return nil, err
	}
	var out outcome
	if err := out.observe(ctx, obs, prefix); err != nil {
		return nil, err
	}
	noStore := storeHeavyWorkload()
	noStore.noHashes = true
	heavy := &mixRun{ids: ids, conns: conns, next: storeHeavy(), t: &out.heavy}
	none := &mixRun{ids: noIDs, conns: noConns, next: gens(noIDs, "y", noStore), t: &out.noStore}
	narrow := &mixRun{ids: narrowIDs, conns: narrowConns, next: gens(narrowIDs, "z", narrowWorkload()), t: &out.narrow}
	prof := startProfile(ctx, cfg, c)
	err = runRounds(ctx, cfg, c, r, heavy, none, narrow)
	if perr := prof.wait(); err == nil {
		err = perr
	}
	if err != nil {
		return nil, err
	}
	if err := fetchAllocs(ctx, cfg, c); err != nil {
		return nil, err
	}
	if got := out.noStore.chunks.Load(); got != 0 {
		return nil, fmt.Errorf("no-store mix: %d chunks stored, want none (a generator bug)", got)
	}
	res.Events, res.Batches, res.Finishes = heavy.events, heavy.batches, heavy.finishes
	res.Seconds, res.NodeCPUSeconds, res.BenchCPUSeconds = heavy.secs(), heavy.nodeCPU, heavy.benchCPU
	res.Requests = int(out.heavy.released.Load())
	res.StoreJobs, res.StoredChunks = int(out.heavy.jobs.Load()), int(out.heavy.chunks.Load())
	res.NoStoreEvents, res.NoStoreSeconds, res.NoStoreCPUSeconds = none.events, none.secs(), none.nodeCPU
	res.NarrowEvents, res.NarrowSeconds, res.NarrowCPUSeconds = narrow.events, narrow.secs(), narrow.nodeCPU
	res.NarrowStoreJobs, res.NarrowStoredChunks = int(out.narrow.jobs.Load()), int(out.narrow.chunks.Load())
	res.NodeMaxRSSBytes = c.maxRSS()
	if g, err := scrape(ctx, "http://"+c.httpAddr+"/metrics"); err == nil {
		res.NodeProcs = int(gatherSum(g, "go_sched_gomaxprocs_threads", "", ""))
	}
	res.derive()
	progress(cfg, "external: node %.0f events/s, %.2f µs node CPU/event (%.2f with nothing stored), raw %.0f events/s",
		res.EventsPerSec, res.NodeUSPerEvent, res.NoStoreUSPerEvent, res.RawEventsPerSec)

	obs.Close() // the latency levels time their own engines' stored messages
	res.LatencyWorkload = "store-heavy, shared 0"
	res.LatencyBasePerSec = res.EventsPerSec
	if cfg.ExternalRate > 0 {
		res.LatencyBasePerSec = cfg.ExternalRate
	}
	if res.Latency, err = externalLatency(ctx, cfg, c, r, res.LatencyBasePerSec); err != nil {
		return nil, err
	}
	return res, nil
}

// mixRun is one mix: its engines, its generator, and what its rounds
// published and cost.
type mixRun struct {
	ids                       []string
	conns                     []*nats.Conn
	next                      func() [][]batch
	t                         *replies // its engines' releases
	events, batches, finishes int
	nodeCPU, benchCPU         float64
	elapsed                   time.Duration
}

func (m *mixRun) secs() float64 { return m.elapsed.Seconds() }

// runRounds runs the mixes in rounds, one chunk of each per round, until
// the first has run cfg.Duration: a slow spell of a shared machine falls on
// all of them alike, so their differences (what storing adds, the per-unit
// costs) are not made of the machine's drift between one mix and the next.
func runRounds(ctx context.Context, cfg Config, c *child, r *rig, mixes ...*mixRun) error {
	for n := 0; n == 0 || mixes[0].elapsed < cfg.Duration; n++ {
		for _, m := range mixes {
			if err := m.round(ctx, c, r); err != nil {
				return err
			}
		}
	}
	return nil
}

// round publishes one chunk of the mix, unthrottled (it fits the child's
// intake budget), and times it until every request it finished was
// released.
func (m *mixRun) round(ctx context.Context, c *child, r *rig) error {
	chunk := m.next()
	streams := make([]stream, len(chunk))
	want := m.t.released.Load()
	for i, bs := range chunk {
		streams[i] = stream{nc: m.conns[i], subject: r.subject(m.ids[i], "events"), batches: bs}
		for _, b := range bs {
			m.events += int(b.events)
			m.finishes += int(b.finishes)
			want += int64(b.finishes)
		}
		m.batches += len(bs)
	}
	n0, err := c.cpuSeconds()
	if err != nil {
		return err
	}
	b0, start := cpuSeconds(), time.Now()
	if err := drive(ctx, streams, func() uint64 { return 0 }, 1<<30); err != nil {
		return err
	}
	if err := waitFor(ctx, fmt.Sprintf("%d releases", want), 60*time.Second,
		func() bool { return m.t.released.Load() >= want }); err != nil {
		return fmt.Errorf("%w (child: %s)", err, c.stderr)
	}
	m.elapsed += time.Since(start)
	m.benchCPU += cpuSeconds() - b0
	n1, err := c.cpuSeconds()
	if err != nil {
		return err
	}
	m.nodeCPU += n1 - n0
	return nil
}

// derive computes the rates from the counts.
func (e *External) derive() {
	per := func(cpu float64, n int) float64 {
		if n == 0 {
			return 0
		}
		return cpu * 1e6 / float64(n)
	}
	if e.Seconds > 0 {
		e.EventsPerSec = float64(e.Events) / e.Seconds
	}
	if e.Requests > 0 {
		e.EventsPerReq = float64(e.Events) / float64(e.Requests)
	}
	e.NodeUSPerEvent = per(e.NodeCPUSeconds, e.Events)
	e.NodeUSPerChunk = per(e.NodeCPUSeconds, e.StoredChunks)
	e.NodeUSPerJob = per(e.NodeCPUSeconds, e.StoreJobs)
	e.RawNodeUSPerEvent = per(e.RawNodeCPUSeconds, e.RawEvents)
	e.NoStoreUSPerEvent = per(e.NoStoreCPUSeconds, e.NoStoreEvents)
	e.StoreUSPerChunk = per(e.NodeCPUSeconds-float64(e.Events)*e.NoStoreUSPerEvent/1e6, e.StoredChunks)
	if e.RawEventsPerSec > 0 {
		e.Ratio = e.EventsPerSec / e.RawEventsPerSec
	}
	nsPerEvent := e.NoStoreUSPerEvent / 1e6
	e.UnitUSPerChunk, e.UnitUSPerJob = unitCosts(
		storeMix{e.NodeCPUSeconds - float64(e.Events)*nsPerEvent, e.StoredChunks, e.StoreJobs},
		storeMix{e.NarrowCPUSeconds - float64(e.NarrowEvents)*nsPerEvent, e.NarrowStoredChunks, e.NarrowStoreJobs})
}

// storeMix is what storing added to one mix: the node's CPU seconds beyond
// its events at the nothing-stored cost, and the chunks and jobs stored.
type storeMix struct {
	cpu          float64
	chunks, jobs int
}

// unitCosts solves cpu = chunk·chunks + job·jobs for the two mixes and
// returns both in µs. Mixes whose chunks per job are too alike (or a
// missing one) leave the system ill-conditioned, and a negative cost is
// noise too: it then returns zeros rather than a number the noise made up.
func unitCosts(a, b storeMix) (chunk, job float64) {
	ka, ja, kb, jb := float64(a.chunks), float64(a.jobs), float64(b.chunks), float64(b.jobs)
	det := ka*jb - ja*kb
	if ja == 0 || jb == 0 || math.Abs(det) < 0.2*ka*jb { // chunks per job differ by less than ~20%
		return 0, 0
	}
	chunk = (a.cpu*jb - ja*b.cpu) / det
	job = (ka*b.cpu - a.cpu*kb) / det
	if chunk < 0 || job < 0 {
		return 0, 0
	}
	return chunk * 1e6, job * 1e6
}

// fetch is one of the child's /debug/pprof endpoints read in the
// background while a run goes on (a CPU profile, an execution trace).
type fetch struct {
	done chan error
}

// startFetch copies the child's path into w in the background; with no w
// it does nothing. Cancelling ctx ends the copy.
func startFetch(ctx context.Context, c *child, what, path string, w io.Writer) *fetch {
	f := &fetch{done: make(chan error, 1)}
	if w == nil {
		f.done <- nil
		return f
	}
	go func() { f.done <- c.fetchDebug(ctx, what, path, w) }()
	return f
}

func (f *fetch) wait() error { return <-f.done }

// startProfile takes the child's CPU profile over the node run.
func startProfile(ctx context.Context, cfg Config, c *child) *fetch {
	secs := max(1, int(cfg.Duration.Seconds()+0.5))
	return startFetch(ctx, c, "profile", fmt.Sprintf("/debug/pprof/profile?seconds=%d", secs), cfg.ExternalProfile)
}

// fetchAllocs saves the child's /debug/pprof/allocs: every allocation
// since it started, so mostly the store-heavy run just finished.
func fetchAllocs(ctx context.Context, cfg Config, c *child) error {
	return startFetch(ctx, c, "allocs profile", "/debug/pprof/allocs", cfg.ExternalAllocs).wait()
}

// fetchDebug copies the child's /debug/pprof path into w.
func (c *child) fetchDebug(ctx context.Context, what, path string, w io.Writer) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+c.httpAddr+path, nil)
	if err != nil {
		return fmt.Errorf("child %s: %w", what, err)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return fmt.Errorf("child %s: %w", what, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("child %s: %s", what, resp.Status)
	}
	if _, err := io.Copy(w, resp.Body); err != nil {
		return fmt.Errorf("child %s: %w", what, err)
	}
	return nil
}
