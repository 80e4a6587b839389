package metrics_test

import (
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/disk"
	"github.com/kvactors/kvactors/hostpool"
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
	st := hostpool.Stats{Capacity: 1 << 20, Data: 4096, PageBytes: 1024, FreePages: 3, Pending: 2, Ready: 1}
	metrics.RegisterPool(reg, func() hostpool.Stats { return st })
	require.Equal(t, 3072.0, value(t, reg, "kvactors_pool_bytes", "kind", "free"))
	st.FreePages = 7
	require.Equal(t, 7168.0, value(t, reg, "kvactors_pool_bytes", "kind", "free"))
	require.Equal(t, 4096.0, value(t, reg, "kvactors_pool_bytes", "kind", "data"))
	require.Equal(t, 2.0, value(t, reg, "kvactors_pool_chunks", "state", "pending"))
}

// The disk tier's gauges and counters are read at scrape time.
func TestDiskReadAtScrape(t *testing.T) {
	reg := prometheus.NewRegistry()
	st := disk.Stats{Bytes: 10, Chunks: 2, Hits: 5, WriteBytes: 100}
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
}

func value(t *testing.T, reg *prometheus.Registry, name, label, want string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	require.NoError(t, err)
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == label && l.GetValue() == want {
					if m.Counter != nil {
						return m.Counter.GetValue()
					}
					return m.Gauge.GetValue()
				}
			}
		}
	}
	t.Fatalf("%s{%s=%q} not exported", name, label, want)
	return 0
}
