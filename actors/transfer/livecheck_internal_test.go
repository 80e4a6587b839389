package transfer

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// A worker's live check is bound once and judges the copy it was last
// given: a copy of a silent engine stops, the next copy (of a heard
// engine) through the same check goes on. Without a fence or a silence
// window there is nothing to check.
func TestAWorkersLiveCheckJudgesTheCopyItRunsNow(t *testing.T) {
	now := time.Unix(1000, 0)
	a := &Actor{deps: Deps{Config: Config{EngineSilence: time.Second}, Now: func() time.Time { return now }}}
	lc := a.newLiveCheck()

	silent, heard := &Hearing{}, &Hearing{}
	silent.Heard(now.Add(-2 * time.Second))
	heard.Heard(now)
	c1 := lc.of(&Submit{Hearing: silent})
	require.NotNil(t, c1)
	require.ErrorIs(t, c1(), ErrEngineSilent)
	c2 := lc.of(&Submit{Hearing: heard})
	require.NoError(t, c2())
	require.NoError(t, c1(), "one check, judging the copy it was given last")

	require.Nil(t, lc.of(&Submit{}), "no Hearing, no fence: nothing to check")
	off := (&Actor{deps: Deps{Now: a.deps.Now}}).newLiveCheck()
	require.Nil(t, off.of(&Submit{Hearing: silent}), "no silence window, no fence: nothing to check")

	job := &Submit{Hearing: heard}
	require.Zero(t, testing.AllocsPerRun(100, func() { _ = lc.of(job)() }),
		"a copy's check allocates nothing")
}
