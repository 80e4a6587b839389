package node_test

import (
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/node"
)

// Attack: an engine fills request after request with hashes and block ids,
// each within max_model_len, to hold more memory than the host has
// (--max-requests × max_model_len is terabytes at the defaults). Its
// requests together hold at most --max-request-state-bytes: past it an
// event that would grow their lists is rejected "limit" and changes
// nothing; what released requests held is taken again; another engine is
// unaffected.
func TestHostileRequestStateIsBoundedPerEngine(t *testing.T) {
	t.Parallel()
	// The test engine holds 256 tokens a request: 64 hashes of 8 bytes
	// (16 + 8 bytes each) and 64 block ids (4 bytes), presized for a
	// 256-token prompt: 1792 bytes. Two fit; the third's hashes do not.
	const limit, perRequest = 4096, 64*(16+8) + 64*4
	e := startNode(t, silenceNotTested, func(c *node.Config) { c.MaxRequestStateBytes = limit })
	vic, hs, want := victim(t, e)
	held := func() float64 { return metricValue(t, e.reg, "kvactors_isolation_request_state_bytes", nil) }
	vicHeld := held()
	require.Positive(t, vicHeld, "the victim's live request")
	require.Equal(t, int64(vicHeld), vic.sync().RequestStateBytes)

	mal := e.newEngine("mal", defaultOpts())
	mal.register()
	var full []string
	var ids []int
	for i := range 64 {
		full = append(full, hash("m", i))
		ids = append(ids, i)
	}
	fill := func(r string) {
		mal.send(added(r, 256), hashesEv(r, 0, full...), blocksEv(r, 0, 0, ids...))
	}
	before := rejected(t, e, "limit")
	for _, r := range []string{"m0", "m1", "m2"} {
		fill(r)
	}
	st := mal.sync()
	require.Equal(t, before+1, rejected(t, e, "limit"), "the third request's hashes")
	require.Equal(t, int64(limit), st.RequestStateLimit)
	require.Equal(t, int64(2*perRequest+64*4), st.RequestStateBytes)
	require.Equal(t, vicHeld+float64(st.RequestStateBytes), held())
	got := map[string]int{}
	for _, r := range st.Requests {
		got[r.Request] = r.Hashes
	}
	require.Equal(t, map[string]int{"m0": 64, "m1": 64, "m2": 0}, got, "the refused event changed nothing")
	// The budget is the engine's own: another engine's requests still grow.
	var vh []string
	var vids []int
	for i := range 64 {
		vh, vids = append(vh, hash("w", i)), append(vids, i)
	}
	vic.send(added("v2", 256), hashesEv("v2", 0, vh...), blocksEv("v2", 0, 0, vids...))
	found := false
	for _, r := range vic.sync().Requests {
		if r.Request == "v2" {
			found = true
			require.Equal(t, 64, r.Hashes, "the victim's hashes refused for the attacker's state")
			require.Equal(t, 64, r.Groups[0].Blocks)
		}
	}
	require.True(t, found, "the victim's new request is live")
	require.Equal(t, before+1, rejected(t, e, "limit"), "nothing of the victim's refused")
	vic.send(finishedEv("v2", true, 0, 0))
	recv(t, vic.released, "v2 released")

	// Released requests give their bytes back: the same events apply now.
	for _, r := range []string{"m0", "m1", "m2"} {
		mal.send(finishedEv(r, true, 0, 0))
		rel := recv(t, mal.released, r+" released")
		require.Equal(t, r, rel.Request)
	}
	require.Zero(t, mal.sync().RequestStateBytes)
	for i := range 2 {
		fill(fmt.Sprintf("again%d", i))
	}
	st = mal.sync()
	require.Equal(t, before+1, rejected(t, e, "limit"), "nothing more refused")
	for _, r := range st.Requests {
		require.Equal(t, 64, r.Hashes, r.Request)
		require.Equal(t, 64, r.Groups[0].Blocks, r.Request)
	}
	require.Equal(t, int64(2*perRequest), st.RequestStateBytes)
	intact(t, vic, hs, want)
}
