// Command kube-scheduler is Kubernetes' scheduler, unchanged: the same lines as
// k8s.io/kubernetes/cmd/kube-scheduler, which cannot be imported (it is a main package).
package main

import (
	"os"

	"k8s.io/component-base/cli"
	"k8s.io/kubernetes/cmd/kube-scheduler/app"
)

func main() {
	os.Exit(cli.Run(app.NewSchedulerCommand()))
}
