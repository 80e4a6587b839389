package actors

import (
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/messages"
)

// Subject builds P.E.verb once per engine for the verbs published per
// request or job, and stays right past its bound (it clears and rebuilds).
func TestOutboxSubjectsAreCachedPerEngine(t *testing.T) {
	o := NewOutbox(nil, "kv", nil)
	for _, verb := range []string{messages.VerbReleased, messages.VerbStored, messages.VerbKVEvents,
		messages.VerbResync, "other"} {
		require.Equal(t, "kv.e1."+verb, o.Subject("e1", verb))
	}
	require.Zero(t, testing.AllocsPerRun(100, func() { _ = o.Subject("e1", messages.VerbStored) }),
		"a cached engine's subject is not built again")
	for i := range maxCachedEngines + 10 {
		e := fmt.Sprintf("e%d", i)
		require.Equal(t, "kv."+e+".stored", o.Subject(e, messages.VerbStored))
	}
	require.LessOrEqual(t, o.nsubjects.Load(), int64(maxCachedEngines))
	require.Equal(t, "kv.e1.released", o.Subject("e1", messages.VerbReleased))
}
