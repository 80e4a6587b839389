package cluster

import (
	"bytes"
	"context"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
)

// The counters follow what happened: decisions by action, a fenced
// keep-alive, fetched and served bytes, a corrupt fetch.
func TestMetricsCountDecisionsFencingAndFetches(t *testing.T) {
	t.Parallel()
	s, nc := testkit.NATS(t)
	reg := prometheus.NewRegistry()
	m := NewMetrics(reg)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	open := func(node string) *Owners {
		js, err := jetstream.New(testkit.Connect(t, s))
		require.NoError(t, err)
		o, err := OpenOwners(ctx, js, Config{Node: node, Boot: "b", Lease: testLease}, m)
		require.NoError(t, err)
		return o
	}
	a, b := open("gpu-0"), open("gpu-1")
	_, err := a.Resolve(ctx, "e1", Request{Register: true, Local: true})
	require.NoError(t, err)
	_, err = b.Resolve(ctx, "e1", Request{Register: true, Local: true})
	require.NoError(t, err)
	require.Equal(t, 1.0, testutil.ToFloat64(m.Decisions.WithLabelValues("claim")))
	require.Equal(t, 1.0, testutil.ToFloat64(m.Decisions.WithLabelValues("ignore")))

	// Someone else overwrites the record: a's keep-alive is fenced.
	kv := ownersBucket(t, nc)
	_, err = kv.Put(ctx, "e1", []byte(`{"node":"gpu-7","boot":"x"}`))
	require.NoError(t, err)
	_, err = a.KeepAlive(ctx, "e1")
	require.ErrorIs(t, err, ErrFenced)
	require.Equal(t, 1.0, testutil.ToFloat64(m.Fenced))

	want := randomBytes(11, 3000)
	src := newMemSource()
	src.put("m", "k", want)
	sub, err := ServeFetch(nc, "kvactors", "a", src, m)
	require.NoError(t, err)
	t.Cleanup(func() { _ = sub.Unsubscribe() })
	bad := bytes.Clone(want)
	bad[0] ^= 1
	sub2, err := ServeFetch(nc, "kvactors", "rotten", ChunkSourceFunc(func(string, messages.Key) ([]byte, uint32, error) {
		return bad, CRC32C(want), nil
	}), m)
	require.NoError(t, err)
	t.Cleanup(func() { _ = sub2.Unsubscribe() })
	require.NoError(t, nc.Flush())
	f, err := NewFetcher(testkit.Connect(t, s), Config{}, m)
	require.NoError(t, err)
	_, err = f.Fetch(ctx, "a", "m", "k")
	require.NoError(t, err)
	_, err = f.Fetch(ctx, "rotten", "m", "k")
	require.ErrorIs(t, err, ErrCorrupt)
	require.Equal(t, 3000.0, testutil.ToFloat64(m.FetchBytes))
	require.Equal(t, 6000.0, testutil.ToFloat64(m.ServedBytes))
	require.Equal(t, 1.0, testutil.ToFloat64(m.FetchFailures.WithLabelValues("corrupt")))
	require.Equal(t, 1, testutil.CollectAndCount(m.FetchSeconds))
}

// A fresh registry already lists every labelled cluster counter at 0, for
// every label value the code uses.
func TestMetricsLabelsExistAtZero(t *testing.T) {
	t.Parallel()
	reg := prometheus.NewRegistry()
	NewMetrics(reg)
	want := map[string][]string{
		"kvactors_cluster_ownership_decisions_total": {"serve", "claim", "refuse", "ignore"},
		"kvactors_cluster_fetch_failures_total":      {"corrupt", "piece", "refused", "other"},
		"kvactors_cluster_holders_rejected_total":    {"unattributed", "bad_message", "refused", "no_geometry"},
		"kvactors_cluster_holders_catchups_total":    {"ok", "superseded", "error"},
	}
	families, err := reg.Gather()
	require.NoError(t, err)
	got := map[string][]string{}
	for _, f := range families {
		for _, m := range f.GetMetric() {
			require.Zero(t, m.GetCounter().GetValue())
			for _, l := range m.GetLabel() {
				got[f.GetName()] = append(got[f.GetName()], l.GetValue())
			}
		}
	}
	for name, labels := range want {
		require.ElementsMatch(t, labels, got[name], name)
	}
}
