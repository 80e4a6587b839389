package natsauth

import (
	"fmt"
	"os"
	"path/filepath"
)

// ConfigFile is the configuration's file name in the output directory.
const ConfigFile = "nats-server.conf"

// SecretFile is the file holding user's secret in the output directory:
// <user>.nk (an nkey seed, for nats.NkeyOptionFromSeed or `kvactors serve
// --nats-nkey`) or <user>.password.
func (c Credential) SecretFile() string {
	if c.Seed != "" {
		return c.User + ".nk"
	}
	return c.User + ".password"
}

// Write puts the configuration and every secret into dir (created 0700 if
// missing; files 0600, never overwritten) and returns the paths written.
func (g Generated) Write(dir string) ([]string, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("natsauth: %w", err)
	}
	var paths []string
	put := func(name, data string) error {
		p := filepath.Join(dir, name)
		f, err := os.OpenFile(p, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
		if err != nil {
			return fmt.Errorf("natsauth: %w", err)
		}
		if _, err := f.WriteString(data); err != nil {
			_ = f.Close()
			return fmt.Errorf("natsauth: write %s: %w", p, err)
		}
		paths = append(paths, p)
		return f.Close()
	}
	if err := put(ConfigFile, g.Config); err != nil {
		return paths, err
	}
	for _, c := range g.Creds {
		secret := c.Seed
		if secret == "" {
			secret = c.Password
		}
		if err := put(c.SecretFile(), secret+"\n"); err != nil {
			return paths, err
		}
	}
	return paths, nil
}
