package node

import (
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/messages"
)

// P.E.status gathers are bounded: with maxStatusGathers in flight (held
// here by taking every slot), another status request is answered with a
// limit error at once and counted, and served again once a slot is free. A
// status of an unknown engine is answered and counted as unknown_engine.
func TestStatusGathersAreBoundedAndUnknownEnginesCounted(t *testing.T) {
	t.Parallel()
	n, nc, dir := startInternal(t, nil)
	registerOneEngine(t, nc, dir, "e1")
	rejected := func(label string) float64 { return testutil.ToFloat64(n.metrics.Rejected.WithLabelValues(label)) }

	for range maxStatusGathers {
		n.statusSlots <- struct{}{}
	}
	before := rejected(messages.RejectLimit)
	reply, err := nc.Request("kvactors.e1.status", []byte(`{}`), 5*time.Second)
	require.NoError(t, err)
	require.Contains(t, string(reply.Data), "status requests in flight")
	require.Equal(t, before+1, rejected(messages.RejectLimit))

	<-n.statusSlots
	reply, err = nc.Request("kvactors.e1.status", []byte(`{}`), 5*time.Second)
	require.NoError(t, err)
	require.NotContains(t, string(reply.Data), `"error"`, "served once a slot is free")
	for range maxStatusGathers - 1 {
		<-n.statusSlots
	}

	before = rejected(messages.RejectUnknownEngine)
	reply, err = nc.Request("kvactors.nobody.status", []byte(`{}`), 5*time.Second)
	require.NoError(t, err)
	require.Contains(t, string(reply.Data), "unknown engine")
	require.Equal(t, before+1, rejected(messages.RejectUnknownEngine))
}
