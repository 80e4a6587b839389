package node

import (
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/actors/engine"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/sched"
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

// One engine's status gathers in flight are bounded apart from the node's
// (maxStatusGathersPerEngine): an engine asking without pause, each gather
// taking seconds over many live requests, held every node slot, and the
// other engines' status was refused.
func TestOneEngineCannotHoldEveryStatusSlot(t *testing.T) {
	t.Parallel()
	n, nc, dir := startInternal(t, nil)
	registerOneEngine(t, nc, dir, "e1")
	registerOneEngine(t, nc, dir, "e2")
	e1 := n.engine("e1")
	e1.statusGathers.Store(maxStatusGathersPerEngine) // e1's share in flight
	before := testutil.ToFloat64(n.metrics.Rejected.WithLabelValues(messages.RejectLimit))

	reply, err := nc.Request("kvactors.e1.status", []byte(`{}`), 5*time.Second)
	require.NoError(t, err)
	require.Contains(t, string(reply.Data), "status requests of this engine in flight")
	require.Equal(t, before+1, testutil.ToFloat64(n.metrics.Rejected.WithLabelValues(messages.RejectLimit)))
	require.Empty(t, n.statusSlots, "a refused request holds no node slot")
	reply, err = nc.Request("kvactors.e2.status", []byte(`{}`), 5*time.Second)
	require.NoError(t, err)
	require.NotContains(t, string(reply.Data), `"error"`, "another engine's status is served")

	e1.statusGathers.Store(maxStatusGathersPerEngine - 1)
	reply, err = nc.Request("kvactors.e1.status", []byte(`{}`), 5*time.Second)
	require.NoError(t, err)
	require.NotContains(t, string(reply.Data), `"error"`, "served below its share")
	testkit.Eventually(t, 5*time.Second, time.Millisecond, func() error {
		if g := e1.statusGathers.Load(); g != maxStatusGathersPerEngine-1 {
			return fmt.Errorf("e1 has %d gathers in flight", g)
		}
		return nil
	})
}

// The status errors no request brings about on cue are error replies too,
// exactly {"error","node","boot"} (PROTOCOL.md "Subjects"): an engine that
// did not answer the gather in time, and a page whose one request is over
// the server's max_payload.
func TestStatusErrorsOfTheGatherAndTheEncodingAreErrorReplies(t *testing.T) {
	t.Parallel()
	n, _, _ := startInternal(t, nil)
	huge := StatusReply{Status: engine.Status{Engine: "e1", Requests: []sched.RequestSnapshot{
		{Request: strings.Repeat("r", int(n.nc.MaxPayload()))}}}}
	for what, c := range map[string]struct {
		err  error
		want string
	}{
		"a gather that timed out": {errors.New(`engine "e1" did not answer status within 2s`), "did not answer"},
		"a page over max_payload": {nil, "max_payload"},
	} {
		data, err := json.Marshal(n.statusAnswer(huge, c.err, 0))
		require.NoError(t, err)
		var got map[string]any
		require.NoError(t, json.Unmarshal(data, &got))
		require.Equal(t, []string{"boot", "error", "node"}, slices.Sorted(maps.Keys(got)), "%s: %s", what, data)
		require.Contains(t, got["error"], c.want, what)
		require.Equal(t, n.NodeID(), got["node"], what)
		require.Equal(t, n.Boot(), got["boot"], what)
	}
}

// /debug/engines gathers within P.E.status's bounds: an engine at its
// share is answered with the error, another is served, and with every node
// slot held none is gathered; each gather gives its slot back.
func TestTheAdminStatusTakesTheStatusSlots(t *testing.T) {
	t.Parallel()
	n, nc, dir := startInternal(t, nil)
	registerOneEngine(t, nc, dir, "e1")
	registerOneEngine(t, nc, dir, "e2")
	get := func() map[string]string {
		w := httptest.NewRecorder()
		n.serveEngines(w, httptest.NewRequest("GET", "/debug/engines", nil))
		var out []StatusReply
		require.NoError(t, json.Unmarshal(w.Body.Bytes(), &out))
		errs := map[string]string{}
		for _, st := range out {
			errs[st.Engine] = st.Error
		}
		return errs
	}
	e1 := n.engine("e1")
	e1.statusGathers.Store(maxStatusGathersPerEngine)
	errs := get()
	require.Contains(t, errs["e1"], "status requests of this engine in flight")
	require.Empty(t, errs["e2"])
	require.Empty(t, n.statusSlots, "every gather gave its slot back")
	require.EqualValues(t, maxStatusGathersPerEngine, e1.statusGathers.Load())

	e1.statusGathers.Store(0)
	for range maxStatusGathers {
		n.statusSlots <- struct{}{}
	}
	for id, err := range get() {
		require.Contains(t, err, "status requests in flight", id)
	}
	require.Zero(t, e1.statusGathers.Load(), "a refused gather keeps none of the engine's share")
}

// slotFiller is a response writer that takes every node status slot as
// the first engine snapshot is written to it: a gather after that is
// refused, one before it served.
type slotFiller struct {
	*httptest.ResponseRecorder
	n      *Node
	filled bool
}

func (w *slotFiller) Write(b []byte) (int, error) {
	if !w.filled && strings.Contains(string(b), `"engine"`) {
		w.filled = true
		for range maxStatusGathers {
			w.n.statusSlots <- struct{}{}
		}
	}
	return w.ResponseRecorder.Write(b)
}

// /debug/engines writes each engine's snapshot before it gathers the
// next, so it holds one at a time, not every engine's at once
// (--max-engines of large state): as the first snapshot is written, the
// writer takes every status slot, and each later engine is listed with
// the refusal. Its body is the same JSON as the list encoded whole.
func TestTheAdminStatusStreamsOneEngineAtATime(t *testing.T) {
	t.Parallel()
	n, nc, dir := startInternal(t, nil)
	get := func(w http.ResponseWriter) {
		n.serveEngines(w, httptest.NewRequest("GET", "/debug/engines", nil))
	}
	rec := httptest.NewRecorder()
	get(rec)
	require.Equal(t, "[]\n", rec.Body.String(), "no engine: an empty list")

	ids := []string{"e1", "e2", "e3", "e4"}
	for _, id := range ids {
		registerOneEngine(t, nc, dir, id)
	}
	rec = httptest.NewRecorder()
	get(rec)
	require.Equal(t, "application/json", rec.Header().Get("Content-Type"))
	var out []StatusReply
	require.NoError(t, json.Unmarshal(rec.Body.Bytes(), &out), rec.Body.String())
	var whole strings.Builder
	enc := json.NewEncoder(&whole)
	enc.SetIndent("", "  ")
	require.NoError(t, enc.Encode(out))
	require.Equal(t, whole.String(), rec.Body.String(), "the list as encoded whole")
	got := map[string]string{}
	for _, st := range out {
		got[st.Engine] = st.Error
		require.Equal(t, n.NodeID(), st.Node)
		require.Equal(t, 1, st.Pages)
	}
	require.Equal(t, map[string]string{"e1": "", "e2": "", "e3": "", "e4": ""}, got)

	w := &slotFiller{ResponseRecorder: httptest.NewRecorder(), n: n}
	get(w)
	out = nil
	require.NoError(t, json.Unmarshal(w.Body.Bytes(), &out), w.Body.String())
	require.Len(t, out, len(ids))
	require.Empty(t, out[0].Error, "the first engine is gathered before anything is written")
	for _, st := range out[1:] {
		require.Contains(t, st.Error, "status requests in flight",
			"engine %s gathered before the snapshot ahead of it was written", st.Engine)
	}
}
