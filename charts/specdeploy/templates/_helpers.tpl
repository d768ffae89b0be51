{{/* Chart name, truncated to the 63 characters a label value allows. */}}
{{- define "specdeploy.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Full name of the release's objects. A release called "specdeploy" is not doubled into
"specdeploy-specdeploy".
*/}}
{{- define "specdeploy.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "specdeploy.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "specdeploy.selectorLabels" -}}
app.kubernetes.io/name: {{ include "specdeploy.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{- define "specdeploy.labels" -}}
helm.sh/chart: {{ include "specdeploy.chart" . }}
{{ include "specdeploy.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: specdeploy
{{- end }}

{{- define "specdeploy.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "specdeploy.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The namespaces served when watch.clusterWide is false: the release namespace by default. */}}
{{- define "specdeploy.watchNamespaces" -}}
{{- if .Values.watch.namespaces }}
{{- join "," (uniq .Values.watch.namespaces) }}
{{- else }}
{{- .Release.Namespace }}
{{- end }}
{{- end }}

{{- define "specdeploy.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{- define "specdeploy.engineImage" -}}
{{- printf "%s:%s" .Values.engine.image.repository (default .Chart.AppVersion .Values.engine.image.tag) }}
{{- end }}
