package store_test

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
)

func findFile(dir, prefix string) (string, error) {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return "", err
	}
	for _, e := range entries {
		if strings.HasPrefix(e.Name(), prefix) {
			return filepath.Join(dir, e.Name()), nil
		}
	}
	return "", fmt.Errorf("no %s* in %s", prefix, dir)
}

func writeFile(path string, b []byte) error { return os.WriteFile(path, b, 0o644) }
