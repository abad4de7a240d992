{{/* Names and labels shared by the templates. */}}
{{- define "disaggpool.fullname" -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "disaggpool.operatorName" -}}
{{- printf "%s-operator" (include "disaggpool.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "disaggpool.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "disaggpool.operatorName" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "disaggpool.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "disaggpool.labels" -}}
app.kubernetes.io/name: disaggpool
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "disaggpool.selectorLabels" -}}
app.kubernetes.io/name: disaggpool
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}
