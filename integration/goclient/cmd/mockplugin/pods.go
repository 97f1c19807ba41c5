package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"

	pb "github.com/Project-HAMi/hami-mig-sidecar/api/hami/migsidecar/v1"

	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/annotation"
)

// storedPod is what the API server holds for a pod, as far as the plugin cares: identity,
// containers in HAMi order and the annotation text.
type storedPod struct {
	UID        string            `json:"uid"`
	Namespace  string            `json:"namespace"`
	Name       string            `json:"name"`
	Containers []string          `json:"containers"`
	Annotation map[string]string `json:"annotations"`
}

// podStore stands in for the API server. With a file it outlives one run, so a scenario can be
// split around an external sidecar restart and the next run still sees the annotations.
type podStore struct {
	path string
	Pods map[string]*storedPod `json:"pods"`
}

func openPodStore(path string) (*podStore, error) {
	s := &podStore{path: path, Pods: map[string]*storedPod{}}
	if path == "" {
		return s, nil
	}
	data, err := os.ReadFile(path)
	if errors.Is(err, os.ErrNotExist) {
		return s, nil
	}
	if err != nil {
		return nil, err
	}
	if err := json.Unmarshal(data, s); err != nil {
		return nil, fmt.Errorf("pod store %s: %w", path, err)
	}
	return s, nil
}

func (s *podStore) save() error {
	if s.path == "" {
		return nil
	}
	data, err := json.MarshalIndent(s, "", "  ")
	if err != nil {
		return err
	}
	tmp, err := os.CreateTemp(filepath.Dir(s.path), ".pods-*")
	if err != nil {
		return err
	}
	if _, err := tmp.Write(data); err != nil {
		_ = tmp.Close()
		return err
	}
	if err := tmp.Close(); err != nil {
		return err
	}
	return os.Rename(tmp.Name(), s.path)
}

func podKey(ns, name string) string { return ns + "/" + name }

func (s *podStore) get(ns, name string) (*storedPod, error) {
	p, ok := s.Pods[podKey(ns, name)]
	if !ok {
		return nil, fmt.Errorf("pod %s/%s not found", ns, name)
	}
	return p, nil
}

func (p *storedPod) parsed() (annotation.Pod, error) {
	allocs, err := annotation.Parse(p.Annotation[annotation.Key])
	if err != nil {
		return annotation.Pod{}, fmt.Errorf("pod %s/%s: %w", p.Namespace, p.Name, err)
	}
	return annotation.Pod{UID: p.UID, Namespace: p.Namespace, Name: p.Name, ContainerNames: p.Containers, Allocations: allocs}, nil
}

// listActive is the plugin's fresh pod list turned into active allocations. One bad annotation
// fails the whole list: a pod missing from it would be released.
func (s *podStore) listActive(includePending bool) func(context.Context) ([]*pb.ActiveAllocation, error) {
	return func(context.Context) ([]*pb.ActiveAllocation, error) {
		keys := make([]string, 0, len(s.Pods))
		for k := range s.Pods {
			keys = append(keys, k)
		}
		sort.Strings(keys)
		var out []*pb.ActiveAllocation
		for _, k := range keys {
			pod, err := s.Pods[k].parsed()
			if err != nil {
				return nil, err
			}
			active, err := pod.ActiveAllocations(includePending)
			if err != nil {
				return nil, err
			}
			out = append(out, active...)
		}
		return out, nil
	}
}
