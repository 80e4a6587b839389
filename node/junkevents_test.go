package node_test

import (
	"encoding/json"
	"fmt"
	"log/slog"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/node"
)

// Attack: one batch of 1,000 junk events around a request's good ones. The
// decoder details only the batch's first 16 rejections (ingest's
// DetailedEventErrors) and counts the rest per reason: every rejected event
// is still counted once under its reason, the good events are applied, and
// the log holds a line per detailed event and one per reason for the rest
// (its count exact), not one per event.
func TestJunkEventsInABatchAreCountedExactlyAndLoggedBriefly(t *testing.T) {
	t.Parallel()
	var logs testkit.SyncBuffer
	e := startNode(t, func(c *node.Config) { c.Log = slog.New(slog.NewTextHandler(&logs, nil)) })
	te := e.newEngine("e1", defaultOpts())
	te.register()
	te.fill(0, 5, 1)
	hs := []string{hash("j", 0)}

	junk := []struct{ event, reason string }{
		{`1`, messages.RejectWrongType},
		{`{"type":"zz","request":"r"}`, messages.RejectUnknownType},
		{`{"type":"resumed","request":""}`, messages.RejectBadRequestID},
		{`{"type":"blocks","request":"r","ids":[-1]}`, messages.RejectOutOfRange},
		{`{"type":"hashes","request":"r","hashes":["0G"]}`, messages.RejectBadHash},
	}
	good := []map[string]any{added("r", 4), hashesEv("r", 0, hs...), blocksEv("r", 0, 0, 5), tokensEv("r", 4, 4)}
	const junkEvents = 1000
	var elems []string
	want := map[string]int{}
	for i := range junkEvents {
		if i%250 == 100 { // the good events, in order, among the junk
			b, err := json.Marshal(good[i/250])
			require.NoError(t, err)
			elems = append(elems, string(b))
		}
		j := junk[i%len(junk)]
		elems = append(elems, j.event)
		want[j.reason]++
	}
	before := map[string]float64{}
	for r := range want {
		before[r] = rejected(t, e, r)
	}
	total := metricValue(t, e.reg, "kvactors_events_rejected_total", nil)
	te.seq++
	te.sendRaw([]byte(fmt.Sprintf(`{"epoch":%q,"seq":%d,"events":[%s]}`, te.epoch, te.seq, strings.Join(elems, ","))))

	// The good events were applied: r's chunk is stored and looks up. The
	// worker counted and logged the rejections before it sent the batch on.
	require.Equal(t, "r", recv(t, te.stored, "r's chunk").Request)
	require.Equal(t, 4, te.lookup(hs))
	for r, n := range want {
		require.Equal(t, before[r]+float64(n), rejected(t, e, r), "rejected{reason=%q}", r)
	}
	require.Equal(t, total+junkEvents, metricValue(t, e.reg, "kvactors_events_rejected_total", nil),
		"counted once each, under no other reason")

	out := logs.String()
	require.Equal(t, 16, strings.Count(out, `msg="event rejected"`), "the detailed ones:\n%s", out)
	// The 16 detailed lines leave each reason room in its burst of 5 for its
	// summary line: every one is logged, with the exact count.
	summary := regexp.MustCompile(`msg="more events rejected" .*engine=e1 count=(\d+) .* reason=(\w+)`)
	lines := summary.FindAllStringSubmatch(out, -1)
	require.Len(t, lines, len(junk), "one line per reason for the rest:\n%s", out)
	logged := map[string]int{}
	for _, l := range lines {
		n, err := strconv.Atoi(l[1])
		require.NoError(t, err)
		logged[l[2]] += n
	}
	for _, l := range strings.Split(out, "\n") {
		if strings.Contains(l, `msg="event rejected"`) {
			m := regexp.MustCompile(`reason=(\w+)`).FindStringSubmatch(l)
			require.NotNil(t, m, l)
			logged[m[1]]++
		}
	}
	require.Equal(t, want, logged, "the log accounts for every rejection, by reason")
	require.Less(t, strings.Count(out, "\n"), 40, "the log is bounded, not a line per event:\n%s", out)
}
