package messages_test

import (
	"errors"
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/ingest"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/sched"
)

// One table: every label once; the most specific label wins however the
// error was wrapped; an error with no Rejection is "other".
func TestRejectLabel(t *testing.T) {
	seen := map[string]bool{}
	for _, l := range messages.RejectLabels {
		require.False(t, seen[l], "label %q twice", l)
		seen[l] = true
	}
	why := messages.NewRejection(messages.RejectWrongType, "why")
	what := messages.NewRejection(messages.RejectBadEvent, "what")
	for _, c := range []struct {
		err  error
		want string
	}{
		{nil, messages.RejectOther},
		{errors.New("plain"), messages.RejectOther},
		{what, messages.RejectBadEvent},
		{fmt.Errorf("%w: %w", what, why), messages.RejectWrongType},
		{fmt.Errorf("ctx: %w", fmt.Errorf("%w: %w", what, why)), messages.RejectWrongType},
		{errors.Join(errors.New("x"), what, why), messages.RejectWrongType},
		{ingest.EventError{Err: fmt.Errorf("%w: %w", ingest.ErrBadEvent, ingest.ErrBadHash)}, messages.RejectBadHash},
	} {
		require.Equal(t, c.want, messages.RejectLabel(c.err), "%v", c.err)
	}
}

// Every sentinel that refuses input names a label of the table.
func TestEverySentinelHasALabel(t *testing.T) {
	for _, err := range []error{sched.ErrHole, sched.ErrNegative, sched.ErrConflict, sched.ErrBadGroup,
		sched.ErrBlockRange, sched.ErrPreempted, sched.ErrWrongRequest, sched.ErrBadEventType, sched.ErrReleased,
		sched.ErrPromptMismatch, sched.ErrTooLarge, ingest.ErrMalformed, ingest.ErrBadEvent, ingest.ErrBadSpec, ingest.ErrBadSubject,
		ingest.ErrUnknownType, ingest.ErrBadRequestID, ingest.ErrWrongType, ingest.ErrOutOfRange, ingest.ErrBadHash,
		ingest.ErrTooLarge} {
		require.NotEqual(t, messages.RejectOther, messages.RejectLabel(err), "%v", err)
	}
}

// Subjects are built by messages.EngineSubject / NodeSubject and parsed by
// ingest.ParseSubject, and the two agree.
func TestSubjectsBuildAndParse(t *testing.T) {
	for _, verb := range []string{messages.VerbRegister, messages.VerbEvents, messages.VerbHeartbeat,
		messages.VerbUnregister, messages.VerbLookup, messages.VerbLoad, messages.VerbStatus} {
		e, v, err := ingest.ParseSubject("a.b", messages.EngineSubject("a.b", "e-1_x", verb))
		require.NoError(t, err)
		require.Equal(t, "e-1_x", e)
		require.Equal(t, verb, v)
	}
	// Node subjects never parse as an engine's: _ is reserved.
	_, _, err := ingest.ParseSubject("p", messages.NodeSubject("p", "n1", messages.NodeVerbHello))
	require.ErrorIs(t, err, ingest.ErrBadSubject)
	_, _, err = ingest.ParseSubject("p", "p._node.hello")
	require.ErrorIs(t, err, ingest.ErrBadSubject)
}
