{{/* Chart name, truncated to the DNS label limit. */}}
{{- define "minisgl.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Release-scoped name for the operator's objects. */}}
{{- define "minisgl.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "minisgl.operatorName" -}}
{{- printf "%s-operator" (include "minisgl.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "minisgl.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/part-of: minisgl
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "minisgl.operatorSelectorLabels" -}}
app.kubernetes.io/name: minisgl-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "minisgl.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "minisgl.operatorName" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The ModelServer installed from values (also what `helm test` calls). */}}
{{- define "minisgl.modelServerName" -}}
{{- default (include "minisgl.fullname" .) .Values.modelServer.name | trunc 57 | trimSuffix "-" -}}
{{- end -}}

{{/* Where that ModelServer goes: the namespace the operator watches (a ModelServer anywhere
else would never be reconciled by this release's operator), else the release's. */}}
{{- define "minisgl.modelServerNamespace" -}}
{{- default .Release.Namespace .Values.operator.watchNamespace -}}
{{- end -}}

{{/* Selects ModelServer pods (labels set by the operator on every server pod). */}}
{{- define "minisgl.serverSelector" -}}
app.kubernetes.io/name: minisgl-server
app.kubernetes.io/managed-by: minisgl-operator
{{- end -}}
