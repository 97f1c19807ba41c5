{{- define "fixture.fullname" -}}
{{- if contains .Chart.Name .Release.Name }}{{ .Release.Name | trunc 63 }}{{ else }}{{ printf "%s-%s" .Release.Name .Chart.Name | trunc 63 }}{{ end }}
{{- end -}}
{{- define "fixture.selector" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}
