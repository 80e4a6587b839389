package buildinfo

import (
	"runtime/debug"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestFromBuildInfo(t *testing.T) {
	bi := &debug.BuildInfo{GoVersion: "go1.26.0", Main: debug.Module{Version: "v1.2.3"},
		Settings: []debug.BuildSetting{{Key: "vcs.revision", Value: "abc123"},
			{Key: "vcs.time", Value: "2026-11-30T00:00:00Z"}, {Key: "vcs.modified", Value: "true"}}}
	in := fromBuildInfo(bi, true, "")
	require.Equal(t, Info{Version: "v1.2.3", Revision: "abc123", Time: "2026-11-30T00:00:00Z", Dirty: true,
		GoVersion: "go1.26.0"}, in)
	require.Equal(t, "kvactors v1.2.3, revision abc123 (dirty), built 2026-11-30T00:00:00Z, go1.26.0", in.String())

	// No build info (or no VCS stamp): every field says unknown, none is empty.
	in = fromBuildInfo(nil, false, "")
	require.Equal(t, "unknown", in.Version)
	require.Equal(t, "unknown", in.Revision)
	require.NotEmpty(t, in.GoVersion)

	// A link-time version wins over the module's.
	require.Equal(t, "v9", fromBuildInfo(bi, true, "v9").Version)
}
