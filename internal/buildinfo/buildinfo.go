package buildinfo

import (
	"fmt"
	"runtime"
	"runtime/debug"
)

// version overrides the module version when set at link time:
// -ldflags "-X github.com/kvactors/kvactors/internal/buildinfo.version=v1.2.3".
var version string

// Info describes the running binary. Unknown fields are "unknown" (a
// binary built with -buildvcs=false, or by go run, has no VCS fields).
type Info struct {
	Version   string `json:"version"`
	Revision  string `json:"revision"`
	Time      string `json:"time"`
	Dirty     bool   `json:"dirty"`
	GoVersion string `json:"go_version"`
}

const unknown = "unknown"

// Read returns the running binary's build info.
func Read() Info {
	bi, ok := debug.ReadBuildInfo()
	return fromBuildInfo(bi, ok, version)
}

func fromBuildInfo(bi *debug.BuildInfo, ok bool, override string) Info {
	in := Info{Version: unknown, Revision: unknown, Time: unknown, GoVersion: runtime.Version()}
	if ok {
		if v := bi.Main.Version; v != "" {
			in.Version = v // "(devel)" for a build from a checkout
		}
		in.GoVersion = bi.GoVersion
		for _, s := range bi.Settings {
			switch s.Key {
			case "vcs.revision":
				in.Revision = s.Value
			case "vcs.time":
				in.Time = s.Value
			case "vcs.modified":
				in.Dirty = s.Value == "true"
			}
		}
	}
	if override != "" {
		in.Version = override
	}
	return in
}

// String is the one-line form `kvactors version` prints.
func (in Info) String() string {
	dirty := ""
	if in.Dirty {
		dirty = " (dirty)"
	}
	return fmt.Sprintf("kvactors %s, revision %s%s, built %s, %s", in.Version, in.Revision, dirty, in.Time, in.GoVersion)
}
