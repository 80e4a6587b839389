package metrics

import (
	"github.com/kvactors/kvactors/hostpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
)

// Metrics is every collector set of a node, built on one registerer. The
// sets are embedded so a holder of the whole reads any collector by name; a
// component that needs one subsystem takes only its set.
type Metrics struct {
	*Events
	*Engines
	*Store
	*Transfer
	*Load
	*NATS
	*Actors
}

// New builds every set and registers them (plus Go and process collectors)
// on reg.
func New(reg prometheus.Registerer) *Metrics {
	m := &Metrics{Events: NewEvents(reg), Engines: NewEngines(reg), Store: NewStore(reg),
		Transfer: NewTransfer(reg), Load: NewLoad(reg), NATS: NewNATS(reg), Actors: NewActors(reg)}
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return m
}

// Discard returns metrics registered nowhere, for tests and benchmarks that
// do not read them.
func Discard() *Metrics { return New(prometheus.NewRegistry()) }

func counter(sub, name, help string) prometheus.Counter {
	return prometheus.NewCounter(prometheus.CounterOpts{Namespace: "kvactors", Subsystem: sub, Name: name, Help: help})
}

func counterVec(sub, name, help, label string) *prometheus.CounterVec {
	return prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: "kvactors", Subsystem: sub, Name: name,
		Help: help}, []string{label})
}

func gauge(sub, name, help string) prometheus.Gauge {
	return prometheus.NewGauge(prometheus.GaugeOpts{Namespace: "kvactors", Subsystem: sub, Name: name, Help: help})
}

// RegisterPool exports the pool's slot counts, read at scrape time so the
// store path never touches a gauge for them.
func RegisterPool(reg prometheus.Registerer, stats func() hostpool.Stats) {
	desc := prometheus.NewDesc("kvactors_pool_slots", "Pool slots by state.", []string{"state"}, nil)
	reg.MustRegister(poolCollector{desc: desc, stats: stats})
}

type poolCollector struct {
	desc  *prometheus.Desc
	stats func() hostpool.Stats
}

func (p poolCollector) Describe(ch chan<- *prometheus.Desc) { ch <- p.desc }

func (p poolCollector) Collect(ch chan<- prometheus.Metric) {
	st := p.stats()
	for _, v := range []struct {
		state string
		n     int
	}{{"free", st.Free}, {"pending", st.Pending}, {"ready", st.Ready}, {"pinned", st.Pinned}} {
		ch <- prometheus.MustNewConstMetric(p.desc, prometheus.GaugeValue, float64(v.n), v.state)
	}
}

// RegisterIsolation exports the isolation bounds' usage, read at scrape
// time: engine segments mapped now (against --max-mapped-segments) and
// namespaces opened this boot.
func RegisterIsolation(reg prometheus.Registerer, mapped, namespaces func() int) {
	reg.MustRegister(
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "kvactors_isolation_segments_mapped",
			Help: "Engine segments mapped now (bounded by --max-mapped-segments)."},
			func() float64 { return float64(mapped()) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "kvactors_isolation_namespaces",
			Help: "Namespaces opened in this boot (each keeps its geometry for the boot)."},
			func() float64 { return float64(namespaces()) }))
}
