package bench

import (
	"bytes"
	"context"
	"encoding/json"
	"math"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/ingest"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/metrics"
)

// TestRunQuick runs every phase at a tiny size and checks the report is
// sane: positive rates, jobs seen, nothing rejected. No timing is asserted.
func TestRunQuick(t *testing.T) {
	if testing.Short() {
		t.Skip("starts several nodes")
	}
	cfg := Config{Engines: 2, Duration: 200 * time.Millisecond, Quick: true, ScaleRequests: 2000, ScaleBase: 200,
		CopySizes: []int64{64 << 10}, ShmDir: t.TempDir()}
	rep, err := Run(context.Background(), cfg)
	require.NoError(t, err)

	tp := rep.Throughput
	require.NotNil(t, tp)
	require.Positive(t, tp.EventsPerSec)
	require.Positive(t, tp.RawEventsPerSec)
	require.Positive(t, tp.Ratio)
	require.Positive(t, tp.EventsPerCPUSec)
	require.Positive(t, tp.RawEventsPerCPUSec)
	require.Zero(t, tp.Rejected, "the generator sent events the node rejected")
	require.Positive(t, tp.ChunksStored)
	require.InDelta(t, 32, tp.EventsPerBatch, 16, "batches hold 1..64 events")

	require.NotNil(t, rep.Latency)
	require.Len(t, rep.Latency.Levels, 3)
	for _, l := range rep.Latency.Levels {
		require.Positive(t, l.Jobs, "level %v saw no stored jobs", l.Fraction)
		require.Zero(t, l.Unmatched, "stored jobs not attributable to a batch")
		require.Positive(t, l.ClientP50MS)
		require.LessOrEqual(t, l.ClientP50MS, l.ClientP999MS)
		require.Positive(t, l.NodeJobs)
		require.Zero(t, l.RejectedOrFailed)
	}

	require.NotNil(t, rep.Copy)
	require.Len(t, rep.Copy.Sizes, 1)
	c := rep.Copy.Sizes[0]
	require.GreaterOrEqual(t, c.Jobs, 5)
	require.Positive(t, c.NodeGBps)
	require.Positive(t, c.PlainGBps)
	require.Positive(t, c.EndToEndGBps)

	s := rep.Scale
	require.NotNil(t, s)
	require.Positive(t, s.BaseEventsPerSec)
	require.Positive(t, s.EventsPerSec)
	require.Positive(t, s.HeapBytesPerRequest)
	require.Equal(t, float64(cfg.ScaleRequests), s.LiveAtEnd, "every seeded request is live")
	require.Zero(t, s.Rejected)

	require.NotEmpty(t, rep.Goals)
	var table bytes.Buffer
	require.NoError(t, rep.WriteTable(&table))
	for _, want := range []string{"THROUGHPUT", "LATENCY", "COPY", "SCALE", "GOAL"} {
		require.Contains(t, table.String(), want)
	}
	// A quick run judges nothing: no goal row says FAIL (or PASS).
	require.NotContains(t, table.String(), "FAIL")
	for _, g := range rep.Goals {
		require.False(t, g.Judged, g.Name)
	}
	require.True(t, rep.Passed())
	_, err = json.Marshal(rep)
	require.NoError(t, err, "the report must encode (no NaN)")
}

// TestGeneratedBatchesDecode: every generated body is a valid batch with
// the counted events, seq runs 1, 2, 3…, batches hold 1..64 events, and
// every request that ends ends once.
func TestGeneratedBatchesDecode(t *testing.T) {
	gens, streams := mixedStreams("x", engineIDs(2), 20_000, mixedWorkload(), true)
	for i, bs := range streams {
		ended := map[string]int{}
		for j, b := range bs {
			got, bad, err := ingest.DecodeBatch(gens[i].id, b.body, ingest.Limits{})
			require.NoError(t, err)
			require.Empty(t, bad)
			require.EqualValues(t, j+1, got.Seq)
			require.Len(t, got.Events, int(b.events))
			require.True(t, b.events >= 1 && b.events <= 64, "batch of %d events", b.events)
			added := 0
			for _, ev := range got.Events {
				switch ev.Type {
				case messages.EvAdded:
					added++
				case messages.EvFinished:
					ended[ev.Request]++
				}
			}
			require.EqualValues(t, int(b.events)-added, b.applied)
		}
		for req, n := range ended {
			require.Equal(t, 1, n, "request %s finished %d times", req, n)
		}
		require.NotEmpty(t, gens[i].trigger, "chunks became ready")
	}
}

func TestHistogramQuantile(t *testing.T) {
	h := histogram{bounds: []float64{1, 2, 4, math.Inf(1)}, counts: []uint64{10, 20, 20, 20}}
	require.InDelta(t, 1.0, h.quantile(0.5), 1e-9)  // rank 10 ends the first bucket
	require.InDelta(t, 1.5, h.quantile(0.75), 1e-9) // halfway through (1, 2]
	require.InDelta(t, 1.998, h.quantile(0.999), 1e-9)
	inf := histogram{bounds: h.bounds, counts: []uint64{10, 20, 20, 30}}
	require.InDelta(t, 4.0, inf.quantile(0.999), 1e-9) // the +Inf bucket reports the last bound
	before := histogram{bounds: h.bounds, counts: []uint64{10, 10, 10, 10}}
	require.EqualValues(t, 10, h.minus(before).count())
	require.Zero(t, histogram{}.quantile(0.5))
	require.Equal(t, 2.0, pct([]time.Duration{time.Millisecond, 2 * time.Millisecond}, 0.99))
}

// overNear reads the share above the bound nearest the threshold, as the
// Go runtime's coarse scheduling-latency buckets are exported.
func TestHistogramOverNear(t *testing.T) {
	h := histogram{bounds: []float64{8.2e-5, 9.2e-4, 1.05e-2, 0.117, math.Inf(1)}, counts: []uint64{900, 980, 998, 1000, 1000}}
	require.InDelta(t, 0.02, h.overNear(1e-3), 1e-12)  // above 0.92 ms
	require.InDelta(t, 0.002, h.overNear(1e-2), 1e-12) // above 10.5 ms
	require.InDelta(t, 0.1, h.overNear(1e-4), 1e-12)   // above 82 µs
	require.Zero(t, histogram{}.overNear(1e-3))
}

// The runtime metrics each external level reads are the names a node
// exports (a typo would read 0 silently, as against an older node).
func TestRuntimeTailNamesAreExported(t *testing.T) {
	reg := prometheus.NewRegistry()
	metrics.New(reg)
	for _, name := range []string{mSchedLatency, mGCCPU, mCPUTotal, mCPUIdle, mMutexWait} {
		_, err := family(reg, name)
		require.NoError(t, err, name)
	}
}

// A level's runtime figures are the window's growth: the GC share of the
// runtime's busy CPU (total less idle), the mutex wait, and the share of
// runnable waits above the bounds nearest 1 and 10 ms, read from scrapes
// as from a child.
func TestLevelReadsTheRuntimeWindow(t *testing.T) {
	node := func(gc, total, idle, mutex float64, waits ...float64) prometheus.Gatherer {
		reg := prometheus.NewRegistry()
		for name, v := range map[string]float64{mGCCPU: gc, mCPUTotal: total, mCPUIdle: idle, mMutexWait: mutex} {
			c := prometheus.NewCounter(prometheus.CounterOpts{Name: name, Help: "h"})
			c.Add(v)
			reg.MustRegister(c)
		}
		h := prometheus.NewHistogram(prometheus.HistogramOpts{Name: mSchedLatency, Help: "h",
			Buckets: []float64{8.2e-5, 9.2e-4, 1.05e-2, 0.117}})
		for _, w := range waits {
			h.Observe(w)
		}
		reg.MustRegister(h)
		srv := httptest.NewServer(promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
		defer srv.Close()
		g, err := scrape(context.Background(), srv.URL)
		require.NoError(t, err)
		return g
	}
	before := node(1, 10, 6, 0.5, 1e-5)
	// During the window: 2 s of GC in 12 busy (30 total, 18 idle), 1.2 s
	// of mutex wait, 10 waits of which 2 over 0.92 ms and 1 over 10.5 ms.
	after := node(3, 40, 24, 1.7, 1e-5, 1e-5, 1e-5, 1e-5, 1e-5, 1e-5, 1e-5, 1e-5, 2e-3, 5e-2, 1e-5)
	var l ExternalLatencyLevel
	l.readRuntime(window{before, after})
	require.InDelta(t, 2.0/12, l.NodeGCCPUShare, 1e-9)
	require.InDelta(t, 1.2, l.NodeMutexWaitSeconds, 1e-9)
	require.Equal(t, uint64(10), l.NodeRunnableSamples)
	require.InDelta(t, 0.2, l.NodeRunnableOver1MS, 1e-9)
	require.InDelta(t, 0.1, l.NodeRunnableOver10MS, 1e-9)
	require.Contains(t, l.runtimeTail(), "mutex wait 1.200 s")

	// Against a node without the metrics, every figure is 0.
	var old ExternalLatencyLevel
	empty := prometheus.NewRegistry()
	old.readRuntime(window{empty, empty})
	require.Zero(t, old.NodeGCCPUShare+old.NodeMutexWaitSeconds+old.NodeRunnableOver1MS)
	require.Zero(t, old.NodeRunnableSamples)
}

// gatherSum counts a summary's observations (the Go collector's GC pauses
// are one, read per latency level), scraped as text as from a child.
func TestGatherSumCountsSummaries(t *testing.T) {
	reg := prometheus.NewRegistry()
	s := prometheus.NewSummary(prometheus.SummaryOpts{Name: "pauses_seconds", Help: "h"})
	reg.MustRegister(s)
	for range 3 {
		s.Observe(0.001)
	}
	require.Equal(t, 3.0, gatherSum(reg, "pauses_seconds", "", ""))
	srv := httptest.NewServer(promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	defer srv.Close()
	scraped, err := scrape(context.Background(), srv.URL)
	require.NoError(t, err)
	require.Equal(t, 3.0, gatherSum(scraped, "pauses_seconds", "", ""))
}

func TestConfigValidate(t *testing.T) {
	require.NoError(t, Config{}.Validate())
	require.ErrorIs(t, Config{Engines: 65}.Validate(), ErrConfig)
	require.ErrorIs(t, Config{Phases: []string{"nope"}}.Validate(), ErrConfig)
	require.ErrorIs(t, Config{CopySizes: []int64{1}}.Validate(), ErrConfig)
	require.True(t, Config{Phases: []string{PhaseLatency}}.withDefaults().wants(PhaseThroughput))
}

// BenchmarkNodeEvents drives b.N batches of the mixed workload from four
// engines through NATS into a node, flow-controlled, until all are applied.
// Profile the node with: go test -run '^$' -bench NodeEvents -cpuprofile cpu.out ./bench
func BenchmarkNodeEvents(b *testing.B) {
	cfg := Config{Engines: 4, Duration: time.Hour}.withDefaults()
	r, streams := benchRig(b, cfg, b.N)
	ids := engineIDs(cfg.Engines)
	conns := make([]*nats.Conn, len(streams))
	per := make([][]batch, len(streams))
	for i := range streams {
		conns[i], per[i] = streams[i].nc, streams[i].batches
	}
	b.ResetTimer()
	t, err := load(context.Background(), cfg, r.nodeSink(ids, conns), per)
	require.NoError(b, err)
	b.ReportMetric(t.perSec(), "events/s")
	b.ReportMetric(t.perCPUSec(), "events/cpu-s")
}

// BenchmarkRawDecode is the baseline of BenchmarkNodeEvents: the same
// bodies through the same server to a plain subscriber that decodes them.
func BenchmarkRawDecode(b *testing.B) {
	cfg := Config{Engines: 4, Duration: time.Hour}.withDefaults()
	r, streams := benchRig(b, cfg, b.N)
	nc, err := r.connect("raw")
	require.NoError(b, err)
	var taken, events atomic.Uint64
	sub, err := nc.Subscribe("raw.*.events", func(m *nats.Msg) {
		engine, _, _ := ingest.ParseSubject("raw", m.Subject)
		batch, _, _ := ingest.DecodeBatch(engine, m.Data, ingest.Limits{})
		events.Add(uint64(len(batch.Events)))
		taken.Add(1)
	})
	require.NoError(b, err)
	require.NoError(b, sub.SetPendingLimits(-1, -1))
	require.NoError(b, nc.Flush())
	for i := range streams {
		streams[i].subject = "raw." + strings.Split(streams[i].subject, ".")[1] + ".events"
	}
	b.ResetTimer()
	start := time.Now()
	require.NoError(b, drive(context.Background(), streams, taken.Load, cfg.Window))
	require.NoError(b, waitFor(context.Background(), "raw decode", time.Minute,
		func() bool { return taken.Load() >= uint64(b.N) }))
	b.ReportMetric(float64(events.Load())/time.Since(start).Seconds(), "events/s")
}

// BenchmarkGenerate is the cost of encoding the workload, paid before any
// phase starts: it should be far below the node's cost per event.
func BenchmarkGenerate(b *testing.B) {
	g := newEngineGen("e0", "g", 1, eventGeometry(), mixedWorkload())
	events := 0
	for b.Loop() {
		events += int(g.next(1 + g.rng.IntN(64)).events)
	}
	b.ReportMetric(b.Elapsed().Seconds()*1e9/float64(events), "ns/event")
}

// BenchmarkStoreJob is one 16-block store job per op through the node's
// shm backend, publish → stored.
func BenchmarkStoreJob(b *testing.B) {
	for _, size := range []int64{64 << 10, 2 << 20} {
		b.Run(strings.ReplaceAll(sizeLabel(size), " ", ""), func(b *testing.B) {
			ctx := context.Background()
			c, err := newCopyRig(ctx, Config{ShmDir: b.TempDir()}.withDefaults(), size)
			require.NoError(b, err)
			b.Cleanup(c.close)
			j, err := c.warmup(ctx)
			require.NoError(b, err)
			b.SetBytes(copyBlocks * size)
			for b.Loop() {
				_, err := c.job(ctx, j)
				require.NoError(b, err)
				j++
			}
		})
	}
}

// benchRig starts a node with cfg.Engines engines and n batches for them.
func benchRig(b *testing.B, cfg Config, n int) (*rig, []stream) {
	b.Helper()
	cfg.ShmDir = b.TempDir()
	ids := engineIDs(cfg.Engines)
	_, per := mixedStreamsBatches("b", ids, n)
	r, err := startRig(context.Background(), cfg, eventPoolBytes)
	require.NoError(b, err)
	b.Cleanup(r.close)
	streams := make([]stream, len(ids))
	for i, id := range ids {
		nc, _, err := r.engine(context.Background(), id, eventGeometry())
		require.NoError(b, err)
		streams[i] = stream{nc: nc, subject: r.subject(id, "events"), batches: per[i]}
	}
	return r, streams
}

// mixedStreamsBatches is mixedStreams sized in batches rather than events.
func mixedStreamsBatches(tag string, ids []string, n int) ([]*engineGen, [][]batch) {
	gens := make([]*engineGen, len(ids))
	out := make([][]batch, len(ids))
	for i, id := range ids {
		gens[i] = newEngineGen(id, tag, uint64(i+1), eventGeometry(), mixedWorkload())
		for j := 0; j < (n+len(ids)-1)/len(ids); j++ {
			out[i] = append(out[i], gens[i].next(1+gens[i].rng.IntN(64)))
		}
	}
	return gens, out
}

// A full-size run judges its goals: a missed one is FAIL and fails Passed;
// the same numbers at --quick size are "not judged".
func TestGoalsJudgedOnlyAtFullSize(t *testing.T) {
	for _, quick := range []bool{false, true} {
		rep := Report{Quick: quick, Throughput: &Throughput{EventsPerSec: 1, Ratio: 0.1}}
		rep.goals()
		var table bytes.Buffer
		require.NoError(t, rep.WriteTable(&table))
		if quick {
			require.True(t, rep.Passed())
			require.Contains(t, table.String(), notJudged)
			require.NotContains(t, table.String(), "FAIL")
		} else {
			require.False(t, rep.Passed())
			require.Contains(t, table.String(), "FAIL")
		}
	}
}

func TestTriggersAttributeAStoredJobToItsLastReadyChunk(t *testing.T) {
	tr := triggers{}
	tr.record("r", 0, 2, 5)
	tr.record("r", 2, 3, 9)
	tr.record("q", 0, 1, 7)
	job := func(req string, idx ...int) *messages.Stored {
		st := &messages.Stored{Request: req}
		for _, i := range idx {
			st.Chunks = append(st.Chunks, messages.StoredChunk{Group: i % 2, Index: i})
		}
		return st
	}
	require.Equal(t, 5, tr.of(job("r", 0, 1)))
	require.Equal(t, 9, tr.of(job("r", 1, 2)), "the latest chunk's batch")
	require.Equal(t, 7, tr.of(job("q", 0)))
	require.Equal(t, -1, tr.of(job("r", 3)), "a chunk never recorded")
	require.Equal(t, -1, tr.of(job("r", -1)))
	require.Equal(t, -1, tr.of(job("x", 0)), "a request never recorded")
	require.Equal(t, -1, tr.of(job("r")), "no chunks")
}
