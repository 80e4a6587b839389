package node_test

import (
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/node"
)

// Attack: hostile bodies on every request subject of a registered engine,
// sent by that engine itself (the one whose state they could disturb). Each
// is answered with an error, counted once under the reason PROTOCOL.md
// documents for it and under no other, and changes nothing: the engine is
// still registered with its spec, its stored prefix still loads with its
// own bytes, and a chunk that was waiting for its tokens is still stored
// once they come.
func TestHostileBodiesOnEveryRequestSubject(t *testing.T) {
	t.Parallel()
	e := startNode(t, silenceNotTested, func(c *node.Config) { c.Limits.MaxIDs = 64 })
	vic, hs, want := victim(t, e)
	// A second request whose chunk waits only for its tokens.
	r2 := []string{hash("w", 0)}
	vic.fill(0, 20, 9)
	vic.send(added("r2", 4), hashesEv("r2", 0, r2...), blocksEv("r2", 0, 0, 20))

	spec := func(edit func(*messages.EngineSpec)) string {
		s := vic.spec
		s.Segments = append([]messages.Segment(nil), s.Segments...)
		edit(&s)
		b, err := json.Marshal(s)
		require.NoError(t, err)
		return string(b)
	}
	named := func(name string) string {
		return spec(func(s *messages.EngineSpec) { s.Segments[0].Shm = name })
	}
	manyHashes := `{"hashes":["00"` + strings.Repeat(`,"00"`, 64) + `]}`
	cases := []struct {
		name, verb, body, reason string
	}{
		{"register: truncated", "register", `{"tokens_per_hash":`, messages.RejectBadSpec},
		{"register: an array", "register", `[]`, messages.RejectBadSpec},
		{"register: wrong type", "register", `{"tokens_per_hash":"4"}`, messages.RejectBadSpec},
		{"register: no segments", "register", spec(func(s *messages.EngineSpec) { s.Segments = nil }), messages.RejectBadSpec},
		{"register: dot-dot name", "register", named("../vic-seg"), messages.RejectBadSpec},
		{"register: absolute name", "register", named("/dev/shm/vic-seg"), messages.RejectBadSpec},
		{"register: slash in name", "register", named("vic-seg/../vic-seg"), messages.RejectBadSpec},
		{"register: NUL in name", "register", named("vic-seg\x00"), messages.RejectBadSpec},
		{"register: long name", "register", named("vic-" + strings.Repeat("x", 300)), messages.RejectBadSpec},
		{"register: missing object", "register", named("vic-nosuch"), messages.RejectBadSpec},
		{"register: regions past the segment", "register", spec(func(s *messages.EngineSpec) { s.NumGPUBlocks = 1 << 20 }), messages.RejectBadSpec},
		{"heartbeat: empty body", "heartbeat", ``, messages.RejectMalformed},
		{"heartbeat: an array", "heartbeat", `[]`, messages.RejectMalformed},
		{"heartbeat: empty epoch", "heartbeat", `{"epoch":"","seq":1}`, messages.RejectMalformed},
		{"heartbeat: long epoch", "heartbeat", `{"epoch":"` + strings.Repeat("e", 300) + `","seq":1}`, messages.RejectMalformed},
		{"heartbeat: lone surrogate", "heartbeat", `{"epoch":"\ud800","seq":1}`, messages.RejectMalformed},
		{"heartbeat: negative seq", "heartbeat", `{"epoch":"ep1","seq":-1}`, messages.RejectMalformed},
		// A seq no batch can carry: neither a lost tail of the live epoch
		// (a resync) nor the start of a new one (an engine reset).
		{"heartbeat: seq 2^63", "heartbeat", `{"epoch":"ep1","seq":9223372036854775808}`, messages.RejectMalformed},
		{"heartbeat: seq 2^64-1 of a new epoch", "heartbeat", `{"epoch":"ep2","seq":18446744073709551615}`, messages.RejectMalformed},
		{"heartbeat: invalid UTF-8", "heartbeat", "{\"epoch\":\"\xff\",\"seq\":1}", messages.RejectMalformed},
		{"heartbeat: no seq", "heartbeat", `{"epoch":"ep1"}`, messages.RejectMalformed},
		{"heartbeat: null seq", "heartbeat", `{"epoch":"ep1","seq":null}`, messages.RejectMalformed},
		{"lookup: truncated", "lookup", `{"hashes":[`, messages.RejectMalformed},
		{"lookup: wrong type", "lookup", `{"hashes":"00"}`, messages.RejectMalformed},
		{"lookup: bad hash", "lookup", `{"hashes":["0G"]}`, messages.RejectBadHash},
		{"lookup: too many hashes", "lookup", manyHashes, messages.RejectTooLarge},
		{"load: truncated", "load", `{"request":`, messages.RejectMalformed},
		{"load: no request id", "load", `{"hashes":[],"num_tokens":0,"blocks":[[]]}`, messages.RejectBadRequestID},
		{"load: negative tokens", "load", `{"request":"l","hashes":[],"num_tokens":-4,"blocks":[[]]}`, messages.RejectOutOfRange},
		{"load: id past 2^32", "load", `{"request":"l","hashes":["00"],"num_tokens":4,"blocks":[[4294967296]]}`, messages.RejectOutOfRange},
		{"status: an array", "status", `[]`, messages.RejectMalformed},
		{"status: negative page", "status", `{"page":-1}`, messages.RejectOutOfRange},
		{"status: page past the last", "status", `{"page":99}`, messages.RejectOutOfRange},
		{"unknown verb", "explode", `{}`, messages.RejectUnknownVerb},
	}
	total := func() float64 {
		return metricValue(t, e.reg, "kvactors_events_rejected_total", nil)
	}
	for _, c := range cases {
		beforeAll, before := total(), rejected(t, e, c.reason)
		msg, err := testkit.EngineRequest(e.nc, vic.id, "kvactors.vic."+c.verb, []byte(c.body), 5*time.Second)
		require.NoError(t, err, c.name)
		var reply struct {
			OK    bool   `json:"ok"`
			Error string `json:"error"`
		}
		require.NoError(t, json.Unmarshal(msg.Data, &reply), c.name)
		require.False(t, reply.OK, c.name)
		require.NotEmpty(t, reply.Error, "%s: answered with an error", c.name)
		// The counter moves before the reply is published, but wait rather
		// than rely on it.
		testkit.Eventually(t, 5*time.Second, 5*time.Millisecond, func() error {
			if got := rejected(t, e, c.reason); got != before+1 {
				return fmt.Errorf("%s: rejected{reason=%q} = %v, want %v (%s)", c.name, c.reason, got, before+1, reply.Error)
			}
			return nil
		})
		require.Equal(t, beforeAll+1, total(), "%s: counted once, under %s only (%s)", c.name, c.reason, reply.Error)
	}

	require.Zero(t, metricValue(t, e.reg, "kvactors_engine_resets_total", nil), "no refused register reset the engine")
	intact(t, vic, hs, want)
	vic.send(tokensEv("r2", 4, 4))
	got := recv(t, vic.stored, "r2's chunk after the hostile bodies")
	require.Equal(t, "r2", got.Request)
	require.Equal(t, 4, vic.lookup(r2))
}
