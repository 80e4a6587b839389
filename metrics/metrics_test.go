package metrics_test

import (
	"fmt"
	"runtime"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	dto "github.com/prometheus/client_model/go"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/disk"
	"github.com/kvactors/kvactors/hostpool"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/metrics"
)

// Each node builds its collectors on its own registry (two nodes in one
// process do not collide); the delivery counters exist at 0 for every known
// reason before anything happened, so dashboards and alerts see them.
func TestNewRegistersOnItsOwnRegistryWithKnownLabels(t *testing.T) {
	reg := prometheus.NewRegistry()
	m := metrics.New(reg)
	_ = metrics.New(prometheus.NewRegistry()) // a second node: no duplicate registration panic
	for _, name := range []string{"kvactors_dropped_batches_total", "kvactors_resyncs_total"} {
		for _, r := range metrics.ResyncReasons {
			require.Equal(t, 0.0, value(t, reg, name, "reason", r), "%s{reason=%q}", name, r)
		}
	}
	for _, ev := range []string{"disconnect", "reconnect", "slow_consumer", "error"} {
		require.Equal(t, 0.0, value(t, reg, "kvactors_nats_events_total", "event", ev))
	}
	m.DroppedBatch("gap").Inc()
	m.Resync("overflow").Add(2)
	require.Equal(t, 1.0, testutil.ToFloat64(m.DroppedBatches.WithLabelValues("gap")))
	require.Equal(t, 2.0, value(t, reg, "kvactors_resyncs_total", "reason", "overflow"))
	// The pre-resolved hot counters are the labelled children.
	m.Deferral("tokens").Inc()
	m.Retry("pool_full").Inc()
	require.Equal(t, 1.0, value(t, reg, "kvactors_store_deferrals_total", "reason", "tokens"))
	require.Equal(t, 1.0, value(t, reg, "kvactors_store_retries_total", "reason", "pool_full"))
}

// The pool gauges read the pool at scrape time.
func TestPoolGaugesReadAtScrape(t *testing.T) {
	reg := prometheus.NewRegistry()
	st := hostpool.Stats{Capacity: 1 << 20, Data: 4096, PageBytes: 1024, FreePages: 3, Pending: 2, Ready: 1,
		MaxChunks: 65536}
	metrics.RegisterPool(reg, func() hostpool.Stats { return st })
	require.Equal(t, 3072.0, value(t, reg, "kvactors_pool_bytes", "kind", "free"))
	st.FreePages = 7
	require.Equal(t, 7168.0, value(t, reg, "kvactors_pool_bytes", "kind", "free"))
	require.Equal(t, 4096.0, value(t, reg, "kvactors_pool_bytes", "kind", "data"))
	require.Equal(t, 2.0, value(t, reg, "kvactors_pool_chunks", "state", "pending"))
	require.Equal(t, 65536.0, family(t, reg, "kvactors_pool_max_chunks").GetMetric()[0].GetGauge().GetValue())
}

// The disk tier's gauges and counters are read at scrape time.
func TestDiskReadAtScrape(t *testing.T) {
	reg := prometheus.NewRegistry()
	st := disk.Stats{Bytes: 10, Chunks: 2, Hits: 5, WriteBytes: 100, Retired: 1, RemoveFailed: 3, Full: 4}
	metrics.RegisterDisk(reg, func() disk.Stats { return st })
	mfs, err := reg.Gather()
	require.NoError(t, err)
	got := map[string]float64{}
	for _, mf := range mfs {
		m := mf.GetMetric()[0]
		if m.Counter != nil {
			got[mf.GetName()] = m.Counter.GetValue()
		} else {
			got[mf.GetName()] = m.Gauge.GetValue()
		}
	}
	require.Equal(t, 10.0, got["kvactors_disk_bytes"])
	require.Equal(t, 2.0, got["kvactors_disk_chunks"])
	require.Equal(t, 5.0, got["kvactors_disk_hits_total"])
	require.Equal(t, 100.0, got["kvactors_disk_write_bytes_total"])
	require.Equal(t, 1.0, got["kvactors_disk_segments_retired_total"])
	require.Equal(t, 3.0, got["kvactors_disk_segment_delete_failures_total"])
	require.Equal(t, 4.0, got["kvactors_disk_full_total"])
}

// family is name's family on reg, gathered now; the test fails when reg
// does not export it.
func family(t *testing.T, reg *prometheus.Registry, name string) *dto.MetricFamily {
	t.Helper()
	mfs, err := reg.Gather()
	require.NoError(t, err)
	for _, mf := range mfs {
		if mf.GetName() == name {
			return mf
		}
	}
	t.Fatalf("%s not exported", name)
	return nil
}

func value(t *testing.T, reg *prometheus.Registry, name, label, want string) float64 {
	t.Helper()
	for _, m := range family(t, reg, name).GetMetric() {
		for _, l := range m.GetLabel() {
			if l.GetName() == label && l.GetValue() == want {
				if m.Counter != nil {
					return m.Counter.GetValue()
				}
				return m.Gauge.GetValue()
			}
		}
	}
	t.Fatalf("%s{%s=%q} not exported", name, label, want)
	return 0
}

// recorder is a Registerer that keeps what is registered, to read the
// descriptors of collectors that have no children yet.
type recorder struct{ cs []prometheus.Collector }

func (r *recorder) Register(c prometheus.Collector) error   { r.cs = append(r.cs, c); return nil }
func (r *recorder) MustRegister(cs ...prometheus.Collector) { r.cs = append(r.cs, cs...) }
func (r *recorder) Unregister(prometheus.Collector) bool    { return false }

func (r *recorder) names() []string {
	ch := make(chan *prometheus.Desc, 256)
	go func() {
		for _, c := range r.cs {
			c.Describe(ch)
		}
		close(ch)
	}()
	var out []string
	for d := range ch {
		s := d.String() // Desc{fqName: "name", ...}
		out = append(out, s[strings.Index(s, `"`)+1:strings.Index(s, `", help`)])
	}
	slices.Sort(out)
	return out
}

// Each component's set registers its own collectors and only those, so a
// component (or its test) can build just its set; together the sets are
// every kvactors collector New registers, each exactly once; a nil
// registerer builds a set registered nowhere.
func TestEachSetRegistersItsOwn(t *testing.T) {
	sets := map[string]func(prometheus.Registerer){
		"events":   func(r prometheus.Registerer) { metrics.NewEvents(r) },
		"engines":  func(r prometheus.Registerer) { metrics.NewEngines(r) },
		"store":    func(r prometheus.Registerer) { metrics.NewStore(r) },
		"pool":     func(r prometheus.Registerer) { metrics.NewPool(r) },
		"transfer": func(r prometheus.Registerer) { metrics.NewTransfer(r) },
		"load":     func(r prometheus.Registerer) { metrics.NewLoad(r) },
		"nats":     func(r prometheus.Registerer) { metrics.NewNATS(r) },
		"actors":   func(r prometheus.Registerer) { metrics.NewActors(r) },
	}
	prefixes := map[string][]string{
		"events":   {"kvactors_events_", "kvactors_dropped_batches_", "kvactors_resyncs_", "kvactors_ingest_"},
		"engines":  {"kvactors_engine_"},
		"store":    {"kvactors_store_", "kvactors_requests_", "kvactors_pool_evictions_"},
		"pool":     {"kvactors_pool_", "kvactors_store_checksum_"},
		"transfer": {"kvactors_transfer_", "kv_offload_", "kvactors_store_decision_"},
		"load":     {"kvactors_load_"},
		"nats":     {"kvactors_nats_", "kvactors_node_"},
		"actors":   {"kvactors_actor_"},
	}
	var union []string
	for name, build := range sets {
		r := &recorder{}
		build(r)
		got := r.names()
		require.NotEmpty(t, got, name)
		for _, n := range got {
			require.True(t, slices.ContainsFunc(prefixes[name], func(p string) bool { return strings.HasPrefix(n, p) }),
				"set %s registers %s, another subsystem's", name, n)
		}
		union = append(union, got...)
		build(nil)                      // unregistered: no panic
		build(prometheus.NewRegistry()) // a real registry: no duplicate within a set
	}
	slices.Sort(union)
	all := &recorder{}
	metrics.New(all)
	var kv []string
	for _, n := range all.names() {
		if strings.HasPrefix(n, "kv") && n != "kvactors_build_info" { // New's own, not a component's
			kv = append(kv, n)
		}
	}
	require.Equal(t, kv, union)
	require.Len(t, slices.Compact(slices.Clone(union)), len(union), "a collector in two sets")
}

// The Go collector carries the runtime's account of a latency tail: time
// runnable before running, the collector's CPU against the process's, and
// time blocked on mutexes. Each is exported and moves when the process does
// that (the mutex counter also counts the runtime's own locks, so it is
// only shown to move, not to move for this test's contention alone).
func TestRuntimeTailMetrics(t *testing.T) {
	reg := prometheus.NewRegistry()
	metrics.New(reg)
	got := func(name string) (sum float64, count uint64) {
		m := family(t, reg, name).GetMetric()[0]
		if h := m.GetHistogram(); h != nil {
			return h.GetSampleSum(), h.GetSampleCount()
		}
		return m.GetCounter().GetValue(), 0
	}
	runtime.GC()
	gc, _ := got("go_cpu_classes_gc_total_cpu_seconds_total")
	require.Positive(t, gc, "the collector's CPU")
	total, _ := got("go_cpu_classes_total_cpu_seconds_total")
	idle, _ := got("go_cpu_classes_idle_cpu_seconds_total")
	require.Greater(t, total, idle, "the runtime's CPU total has a busy part to divide by")
	_, scheduled := got("go_sched_latencies_seconds")
	require.Positive(t, scheduled, "goroutines scheduled")

	// Contend for a mutex until the (sampled) wait counter has moved.
	before, _ := got("go_sync_mutex_wait_total_seconds_total")
	testkit.Eventually(t, 10*time.Second, time.Millisecond, func() error {
		var mu sync.Mutex
		var wg sync.WaitGroup
		for range 8 {
			wg.Go(func() {
				for range 200 {
					mu.Lock()
					runtime.Gosched() // hold it across a reschedule: the others block
					mu.Unlock()
				}
			})
		}
		wg.Wait()
		if after, _ := got("go_sync_mutex_wait_total_seconds_total"); after <= before {
			return fmt.Errorf("no mutex wait counted yet (%g)", after)
		}
		return nil
	})
}
