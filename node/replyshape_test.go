package node_test

import (
	"encoding/json"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/node"
)

// replyFields decodes a reply's raw bytes and checks that it has exactly
// the fields want (no more, no fewer: a Go struct would hide both), that
// it names the node and its boot, and, for an error reply, that its error
// is a non-empty string. It returns the decoded reply.
func replyFields(t *testing.T, e *env, what string, data []byte, want ...string) map[string]any {
	t.Helper()
	var got map[string]any
	require.NoError(t, json.Unmarshal(data, &got), "%s: %s", what, data)
	keys := slices.Sorted(maps.Keys(got))
	slices.Sort(want)
	require.Equal(t, want, keys, "%s: fields of %s", what, data)
	require.Equal(t, e.node.NodeID(), got["node"], what)
	require.Equal(t, e.node.Boot(), got["boot"], what)
	if slices.Contains(want, "error") {
		msg, ok := got["error"].(string)
		require.True(t, ok && msg != "", "%s: error must be a non-empty string: %s", what, data)
	}
	return got
}

// PROTOCOL.md "Subjects" and v2 "Sessions": each reply has the contract's
// fields, exactly, as published: register {"ok":true,"node","boot",
// "lease_ms"}, heartbeat {"node","boot","epoch","applied","released"},
// lookup {"hit_tokens","node","boot"}, load {"ok":true,"loaded_tokens",
// "node","boot"}, unregister {"ok":true,"released","node","boot"}; and
// every error reply (bad input, a miss, a failed copy, an unknown engine
// or verb, a status refused for its body, its page, the gather bound or a
// full intake) is {"error":"…","node","boot"}: no "ok", and no zero count
// or zeroed snapshot beside the error (a lookup's and a load's once
// carried "hit_tokens":0 and "loaded_tokens":0, a status's the snapshot's
// fields with a zeroed pool). status_internal_test.go covers the status
// errors no request can bring about on cue (a gather that times out, a
// page over max_payload).
func TestEveryReplyHasExactlyTheContractsFields(t *testing.T) {
	t.Parallel()
	e := startNode(t, func(c *node.Config) { c.NodeID = "n-1" })
	te := e.newEngine("e1", defaultOpts())
	errFields := []string{"error", "node", "boot"}

	r := replyFields(t, e, "register", te.request("register", te.spec), "ok", "node", "boot", "lease_ms")
	require.Equal(t, true, r["ok"])
	require.Positive(t, r["lease_ms"])
	recv(t, te.kv, "AllBlocksCleared")
	te.storeOne("r1", 3)
	h := hash("r1", 0)

	r = replyFields(t, e, "heartbeat", te.request("heartbeat", map[string]any{"epoch": "ep1", "seq": 1}),
		"node", "boot", "epoch", "applied", "released")
	require.Equal(t, "ep1", r["epoch"])
	require.Equal(t, 1.0, r["applied"])
	require.Equal(t, 0.0, r["released"])
	r = replyFields(t, e, "lookup", te.request("lookup", map[string]any{"hashes": []string{h}}),
		"hit_tokens", "node", "boot")
	require.Equal(t, 4.0, r["hit_tokens"])
	r = replyFields(t, e, "load", te.request("load", map[string]any{"request": "l", "hashes": []string{h},
		"num_tokens": 4, "blocks": [][]int{{9}}}), "ok", "loaded_tokens", "node", "boot")
	require.Equal(t, true, r["ok"])
	require.Equal(t, 4.0, r["loaded_tokens"])

	for _, c := range []struct {
		what, verb string
		body       any
	}{
		{"register with a bad spec", "register", map[string]any{"tokens_per_hash": -1}},
		{"heartbeat without an epoch", "heartbeat", map[string]any{"seq": 1}},
		{"lookup with a bad body", "lookup", map[string]any{"hashes": "not a list"}},
		{"load with a bad body", "load", map[string]any{"request": "l", "hashes": 3}},
		{"load of a key never stored", "load", map[string]any{"request": "l", "hashes": []string{hash("zz", 0)},
			"num_tokens": 4, "blocks": [][]int{{9}}}},
		{"unknown verb", "bogus", map[string]any{}},
		{"status with a body that is not an object", "status", "not an object"},
		{"status of a negative page", "status", map[string]any{"page": -1}},
		{"status of a page past the last", "status", map[string]any{"page": 1}},
	} {
		replyFields(t, e, c.what, te.request(c.verb, c.body), errFields...)
	}
	// PROTOCOL.md "Words": ids starting with _ are reserved (bad_subject).
	msg, err := testkit.EngineRequest(e.nc, "_e", "kvactors._e.register", []byte(`{}`), 5*time.Second)
	require.NoError(t, err)
	replyFields(t, e, "register of a reserved id", msg.Data, errFields...)

	other := e.newEngine("nobody", defaultOpts())
	for _, verb := range []string{"heartbeat", "unregister", "lookup", "load", "events", "status"} {
		replyFields(t, e, "unknown engine's "+verb, other.request(verb, map[string]any{}), errFields...)
	}
	release := e.node.HoldStatusGathers()
	r = replyFields(t, e, "status past the gather bound", te.request("status", map[string]any{}), errFields...)
	require.Contains(t, r["error"], "status requests in flight")
	release()
	release = e.node.FillIntake(t)
	r = replyFields(t, e, "status dropped by a full intake", te.request("status", map[string]any{}), errFields...)
	require.Contains(t, r["error"], "overloaded")
	release()

	// A load whose copy fails (the engine truncated its own segment: the
	// copy faults) is answered by the load actor, with the same shape.
	require.NoError(t, os.Truncate(filepath.Join(e.dir, te.seg.Name()), 0))
	r = replyFields(t, e, "load whose copy fails", te.request("load", map[string]any{"request": "l",
		"hashes": []string{h}, "num_tokens": 4, "blocks": [][]int{{9}}}), errFields...)
	require.Contains(t, r["error"], "copy failed")

	r = replyFields(t, e, "unregister", te.request("unregister", map[string]any{}), "ok", "released", "node", "boot")
	require.Equal(t, true, r["ok"])
	require.Equal(t, 1.0, r["released"], "r1, live")
	require.Equal(t, "engine_gone", recv(t, te.released, "r1's release").Reason)
}
